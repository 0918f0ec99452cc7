//! The `strata` command line: pack, synth, inspect, verify, generate.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
