//! Frame decode + forward throughput (filled in below).
fn main() {}
