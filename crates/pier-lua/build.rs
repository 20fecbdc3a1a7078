//! Exports nginx's `ngx_hex_dump` and `ngx_atoi` (src/ffi/strings.rs) from
//! this crate's test binaries, so lua-resty-string's `ffi.C` calls find them
//! as they do in the `pier` binary (bin/pier/build.rs).

fn main() {
    for sym in ["ngx_hex_dump", "ngx_atoi"] {
        println!("cargo:rustc-link-arg-tests=-Wl,--export-dynamic-symbol={sym}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
