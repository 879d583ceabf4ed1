fn main() {
    std::process::exit(upipe::cli::main());
}
