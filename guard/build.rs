//! Builds guard-ebpf for the BPF target and leaves the object in OUT_DIR, where the loader
//! embeds it. The BPF target is built with the `debian` toolchain (docs/design.md §3), whose
//! prebuilt `core` for bpfel-unknown-none spares us `-Z build-std`.
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    // Under cargo fuzz (`--cfg fuzzing`) the fuzz targets never load the program, and the
    // fuzzer's instrumentation flags would reach the BPF build: leave an empty object.
    println!("cargo::rustc-check-cfg=cfg(fuzzing)");
    if std::env::var_os("CARGO_CFG_FUZZING").is_some() {
        let out = std::env::var("OUT_DIR").context("OUT_DIR")?;
        std::fs::write(std::path::Path::new(&out).join("guard-ebpf"), b"")
            .context("writing the empty eBPF object")?;
        return Ok(());
    }
    // aya-ebpf uses `#![feature]`; this scope lets only that crate do so, and tells aya-build
    // not to pass `-Z build-std`. SAFETY: build scripts are single-threaded at this point.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "aya_ebpf") };
    let package = aya_build::Package {
        name: "guard-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../guard-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Custom("debian")).context(
        "building guard-ebpf failed: run `cargo xtask setup` (it installs the `debian` \
         toolchain, llvm-22 and bpf-linker)",
    )
}
