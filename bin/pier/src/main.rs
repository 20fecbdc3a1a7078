fn main() {
    println!("pier: under construction");
}
