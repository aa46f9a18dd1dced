fn main() {
    // Migrations are embedded at compile time: rebuild when they change.
    println!("cargo:rerun-if-changed=migrations");
}
