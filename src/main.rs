//! The `strata` command line: pack, synth, inspect, verify, generate, bench, profile.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
