//! The `strata` command line: pack, synth, inspect, generate, bench, profile.

mod cli;

fn main() {
    // A closed output pipe (`strata inspect P | head -1`) ends the process
    // quietly, as it does other command-line tools, instead of making the
    // next print panic (Rust ignores SIGPIPE by default).
    // SAFETY: restores the default action of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    std::process::exit(cli::main());
}
