//! Exports nginx's `ngx_hex_dump` and `ngx_atoi` (defined in pier-lua,
//! src/ffi/strings.rs) in the binary's dynamic symbol table: lua-resty-string
//! calls them through LuaJIT's `ffi.C`, which looks symbols up with dlsym.
//! They are kept by the linker because pier-lua's string API table points
//! at them; this only makes them visible (check: `nm -D target/debug/pier`).

fn main() {
    for sym in ["ngx_hex_dump", "ngx_atoi"] {
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol={sym}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    // The optimised builds are profile-guided by pgo/rustc-wrapper: a new
    // profile, or PIER_PGO=0, rebuilds the binary (whose fat LTO lays the
    // whole program out). The dependencies keep the profile they were
    // compiled with until `cargo clean` (docs/pgo.md).
    println!("cargo:rerun-if-changed=../../pgo/pier.profdata.xz");
    println!("cargo:rerun-if-changed=../../pgo/PROFILE");
    println!("cargo:rerun-if-env-changed=PIER_PGO");
}
