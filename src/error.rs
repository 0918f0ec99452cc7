//! The one error type of the library. Every message names the file, tensor or
//! value at fault so that a user can act on it without a debugger.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS-level I/O failure on a named path (missing, unreadable, disk full).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A pack whose bytes do not follow docs/pack-format.md.
    #[error("pack {path}: {msg}")]
    BadPack { path: PathBuf, msg: String },

    /// A pack written by a newer (or unknown) format version.
    #[error("pack {path}: format version {found} is not supported (this build reads version {supported})")]
    PackVersion { path: PathBuf, found: u32, supported: u32 },

    /// A stored checksum does not match the bytes on disk.
    #[error("pack {path}: checksum mismatch in {what}: manifest says {expected:08x}, data gives {actual:08x}")]
    Checksum { path: PathBuf, what: String, expected: u32, actual: u32 },

    /// A checkpoint directory or file that cannot be converted.
    #[error("checkpoint {path}: {msg}")]
    BadCheckpoint { path: PathBuf, msg: String },

    /// A tensor with the wrong shape or dtype for its role.
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },

    /// A model config that names an architecture or option we do not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),

    /// A config value that is present but invalid (zero heads, odd sizes...).
    #[error("invalid config: {0}")]
    Config(String),

    /// A caller-supplied argument is out of range (token id, sampling value...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A token id outside the model's vocabulary (prompts, detokenize).
    #[error("token {token} at index {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { token: i64, index: usize, vocab: usize },

    /// An id that names nothing (an unknown, released or invalidated checkpoint).
    #[error("not found: {0}")]
    NotFound(String),

    /// The model produced NaN or infinity (the message says where).
    #[error("non-finite values: {0}")]
    NonFinite(String),

    /// The session's context window cannot hold the requested tokens.
    #[error("context overflow: {needed} tokens needed, the session holds at most {capacity}")]
    ContextOverflow { needed: usize, capacity: usize },

    /// Tokenizer missing or failing.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The operation was cancelled by a caller's callback.
    #[error("cancelled")]
    Cancelled,

    /// No CUDA device or driver is available (or the build has no CUDA support).
    #[error("no CUDA device: {0}")]
    NoCuda(String),

    /// A CUDA driver, cuBLAS or kernel failure on a device that exists
    /// (the message names the call or kernel). Present in every build so
    /// that matches stay the same; only the `cuda` feature produces it.
    #[error("CUDA error: {0}")]
    Cuda(String),
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(e.to_string())
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        Error::Cuda(format!("cuBLAS: {e}"))
    }
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub fn bad_pack(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::BadPack { path: path.into(), msg: msg.into() }
    }

    pub fn bad_checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::BadCheckpoint { path: path.into(), msg: msg.into() }
    }

    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), msg: msg.into() }
    }
}
