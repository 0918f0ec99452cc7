//! Progress of the long steps (loading a model, verifying a pack) on
//! stderr: a bar on a terminal, else a line at every tenth once the step
//! has run for a few seconds (a short step prints nothing).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How long a step runs before a redirected stderr gets its first line.
const QUIET: Duration = Duration::from_secs(2);

pub struct Progress {
    what: String,
    bar: Option<ProgressBar>,
    start: Instant,
    /// Tenths reported so far (redirected stderr).
    shown: u32,
}

impl Progress {
    /// Progress of the step `what` ("loading P").
    pub fn new(what: String) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let pb = ProgressBar::new(1000);
            if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {percent}% ({elapsed}, {eta} left)") {
                pb.set_style(style);
            }
            pb.set_message(what.clone());
            pb
        });
        Progress { what, bar, start: Instant::now(), shown: 0 }
    }

    /// The step is `fraction` (0..=1) done.
    pub fn set(&mut self, fraction: f64) {
        let f = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
        if let Some(pb) = &self.bar {
            pb.set_position((f * 1000.0) as u64);
            return;
        }
        let tenths = (f * 10.0) as u32;
        if tenths > self.shown && self.start.elapsed() >= QUIET {
            self.shown = tenths;
            eprintln!("strata: {}: {}%", self.what, tenths * 10);
        }
    }

    /// The step ended (the bar is cleared).
    pub fn finish(self) {
        if let Some(pb) = self.bar {
            pb.finish_and_clear();
        }
    }
}
