"""Python bindings for the Strata C API (ctypes, no build step).

The library is loaded from $STRATA_LIB, else from ../../target/release/
relative to this file (the repository's `cargo build --release` output).

    import strata
    with strata.Engine("path/to/pack") as engine:
        print(engine.info)
        with engine.session() as s:
            s.prefill([1, 2, 3])
            tokens = s.generate(16, strata.Sampling(temperature=0.8, top_k=40, seed=42))

Engine is thread-safe; a Session is used by one thread at a time (concurrent
use raises StrataError with status BUSY). Every failure raises StrataError
carrying the status code and the library's message for it.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_bool,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
    sizeof,
)
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "Status",
    "LogLevel",
    "KvType",
    "StrataError",
    "ModelInfo",
    "Sampling",
    "Engine",
    "Session",
    "version",
    "abi_version",
    "set_log_callback",
    "lib",
]

ABI_VERSION = 1


class Status(IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    NULL_POINTER = 2
    IO = 3
    BAD_PACK = 4
    UNSUPPORTED = 5
    TOKEN_OUT_OF_RANGE = 6
    CONTEXT_OVERFLOW = 7
    BUSY = 8
    CANCELLED = 9
    NO_CUDA = 10
    TOKENIZER = 11
    BUFFER_TOO_SMALL = 12
    NOT_FOUND = 13
    NONFINITE = 14
    INTERNAL = 15


class LogLevel(IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


class KvType(IntEnum):
    AUTO = 0
    F32 = 1
    BF16 = 2
    INT8 = 3


class StrataError(Exception):
    """A failed call: `status` (a Status, or the raw int if unknown),
    `status_message` (the library's text for it) and `message`
    (strata_last_error() of the calling thread)."""

    def __init__(self, function: str, status: int, message: str):
        try:
            self.status = Status(status)
        except ValueError:
            self.status = status
        self.function = function
        self.status_message = _text(_lib.strata_status_message(status))
        self.message = message
        name = self.status.name if isinstance(self.status, Status) else str(status)
        # The library's message already names the function that failed.
        super().__init__(f"{message or function} ({name}: {self.status_message})")


# --- C structures (struct_size is set to sizeof by the constructor) ---------

_progress_fn = ctypes.CFUNCTYPE(c_bool, c_void_p, c_float)
_log_fn = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_char_p)


class _Sized(Structure):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.struct_size = sizeof(self)


class EngineParams(_Sized):
    _fields_ = [
        ("struct_size", c_uint32),
        ("devices", POINTER(c_char_p)),
        ("n_threads", c_uint32),
        ("vram_budget_bytes", c_uint64),
        ("host_budget_bytes", c_uint64),
        ("verify_checksums", c_bool),
        ("progress", _progress_fn),
        ("progress_user_data", c_void_p),
        ("gpu_precision", c_int),
        ("layer_split", POINTER(c_uint32)),
        ("n_layer_split", c_uint32),
        ("prefill_help", c_int),
        ("stage_memory_bytes", POINTER(c_uint64)),
        ("n_stage_memory", c_uint32),
        ("stage_memory_context", c_uint32),
    ]


class ModelInfoC(_Sized):
    _fields_ = [
        ("struct_size", c_uint32),
        ("vocab_size", c_uint32),
        ("hidden_size", c_uint32),
        ("num_layers", c_uint32),
        ("num_experts", c_uint32),
        ("num_experts_per_tok", c_uint32),
        ("max_context", c_uint32),
        ("has_tokenizer", c_bool),
    ]


class SessionParams(_Sized):
    _fields_ = [
        ("struct_size", c_uint32),
        ("context_size", c_uint32),
        ("prefill_chunk", c_uint32),
        ("kv_type", c_int),
        ("keep_all_logits", c_bool),
        ("checkpoint_every", c_uint32),
        ("checkpoint_budget", c_uint64),
    ]


class SamplingParams(_Sized):
    _fields_ = [
        ("struct_size", c_uint32),
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("seed", c_uint64),
    ]


class _Engine(Structure):
    pass


class _Session(Structure):
    pass


_EngineP = POINTER(_Engine)
_SessionP = POINTER(_Session)


# --- loading the library ----------------------------------------------------


def _default_path() -> str:
    env = os.environ.get("STRATA_LIB")
    if env:
        return env
    return str(Path(__file__).resolve().parent.parent.parent / "target" / "release" / "libstrata.so")


def _text(p: Optional[bytes]) -> str:
    return p.decode("utf-8", "replace") if p is not None else ""


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    st = c_int  # strata_status is a C enum: int-sized
    sigs = {
        "strata_abi_version": (c_uint32, []),
        "strata_version": (c_char_p, []),
        "strata_status_message": (c_char_p, [c_int]),
        "strata_last_error": (c_char_p, []),
        "strata_set_log_callback": (st, [_log_fn, c_void_p, c_int]),
        "strata_engine_default_params": (st, [POINTER(EngineParams), c_uint32]),
        "strata_engine_load": (st, [c_char_p, POINTER(EngineParams), POINTER(_EngineP)]),
        "strata_engine_free": (None, [_EngineP]),
        "strata_engine_info": (st, [_EngineP, POINTER(ModelInfoC)]),
        "strata_session_default_params": (st, [POINTER(SessionParams), c_uint32]),
        "strata_session_open": (st, [_EngineP, POINTER(SessionParams), POINTER(_SessionP)]),
        "strata_session_free": (None, [_SessionP]),
        "strata_session_prefill": (st, [_SessionP, POINTER(c_int32), c_size_t]),
        "strata_session_prefill_conversation": (
            st,
            [_SessionP, POINTER(c_int32), c_size_t, POINTER(c_size_t), POINTER(c_size_t)],
        ),
        "strata_sampling_default_params": (st, [POINTER(SamplingParams), c_uint32]),
        "strata_session_step": (st, [_SessionP, POINTER(SamplingParams), POINTER(c_int32)]),
        "strata_session_logits": (st, [_SessionP, c_int64, POINTER(c_float), c_size_t, POINTER(c_size_t)]),
        "strata_session_position": (st, [_SessionP, POINTER(c_size_t)]),
        "strata_session_checkpoint": (st, [_SessionP, POINTER(c_uint64)]),
        "strata_session_rewind": (st, [_SessionP, c_uint64]),
        "strata_session_rewind_to": (st, [_SessionP, c_size_t]),
        "strata_session_checkpoint_release": (st, [_SessionP, c_uint64]),
        "strata_session_state_size": (st, [_SessionP, POINTER(c_size_t)]),
        "strata_session_state_save": (st, [_SessionP, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
        "strata_session_state_load": (st, [_SessionP, POINTER(c_uint8), c_size_t]),
        "strata_tokenize": (st, [_EngineP, c_char_p, c_size_t, POINTER(c_int32), c_size_t, POINTER(c_size_t)]),
        "strata_detokenize": (
            st,
            [_EngineP, POINTER(c_int32), c_size_t, POINTER(c_char), c_size_t, POINTER(c_size_t)],
        ),
        "strata_engine_eos_tokens": (st, [_EngineP, POINTER(c_int32), c_size_t, POINTER(c_size_t)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    got = lib.strata_abi_version()
    if got < ABI_VERSION:
        raise OSError(f"{path}: C ABI {got}, these bindings need {ABI_VERSION}")
    return lib


_lib = _load(_default_path())
lib = _lib  # the raw ctypes library, for calls these classes do not wrap


def _check(function: str, status: int) -> None:
    # strata_last_error() is per thread and valid until the next call on this
    # thread: read it right away (ctypes calls run on the calling thread).
    if status != Status.OK:
        raise StrataError(function, status, _text(_lib.strata_last_error()))


def version() -> str:
    return _text(_lib.strata_version())


def abi_version() -> int:
    return _lib.strata_abi_version()


_log_keepalive = None


def set_log_callback(fn, max_level: LogLevel = LogLevel.WARN) -> None:
    """fn(level: LogLevel, message: str), or None to turn logging off. The
    library may call it from any thread."""
    global _log_keepalive
    if fn is None:
        cb = _log_fn()
    else:

        def cb_py(_user, level, message):
            try:
                fn(LogLevel(level), _text(message))
            except Exception:  # an exception must not unwind into C
                pass

        cb = _log_fn(cb_py)
    _check("strata_set_log_callback", _lib.strata_set_log_callback(cb, None, int(max_level)))
    _log_keepalive = cb  # the library holds the pointer: keep it alive


# --- Pythonic layer -----------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    max_context: int
    has_tokenizer: bool


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; the defaults are greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def _c(self) -> SamplingParams:
        p = SamplingParams()
        _check("strata_sampling_default_params", _lib.strata_sampling_default_params(byref(p), sizeof(p)))
        p.temperature = self.temperature
        p.top_k = self.top_k
        p.top_p = self.top_p
        p.min_p = self.min_p
        p.seed = self.seed
        return p


GREEDY = Sampling()


class Engine:
    """A loaded pack. Thread-safe; sessions keep the model alive, so the
    engine may be closed before its sessions."""

    def __init__(
        self,
        pack: "str | os.PathLike[str]",
        *,
        devices: Optional[Sequence[str]] = None,
        n_threads: int = 0,
        verify_checksums: bool = False,
        progress=None,
        layer_split: Optional[Sequence[int]] = None,
        prefill_help: str = "auto",
        stage_memory_bytes: Optional[Sequence[int]] = None,
        stage_memory_context: int = 0,
    ):
        """progress(fraction) -> bool: return False to cancel the load.
        With several devices: layer_split, the first layer of each stage
        after the first (default: even), or stage_memory_bytes, one memory
        budget per device that chooses the split (stage_memory_context: the
        tokens of one session's KV each budget also holds); and prefill_help
        "auto", "on" or "off"."""
        self._ptr = None
        params = EngineParams()
        _check("strata_engine_default_params", _lib.strata_engine_default_params(byref(params), sizeof(params)))
        params.n_threads = n_threads
        params.verify_checksums = verify_checksums
        if devices is not None:
            arr = (c_char_p * (len(devices) + 1))(*[d.encode() for d in devices], None)
            params.devices = ctypes.cast(arr, POINTER(c_char_p))
        if layer_split is not None:
            self._split = (c_uint32 * len(layer_split))(*layer_split)  # read during the load only
            params.layer_split = ctypes.cast(self._split, POINTER(c_uint32))
            params.n_layer_split = len(layer_split)
        if stage_memory_bytes is not None:
            self._budgets = (c_uint64 * len(stage_memory_bytes))(*stage_memory_bytes)  # read during the load only
            params.stage_memory_bytes = ctypes.cast(self._budgets, POINTER(c_uint64))
            params.n_stage_memory = len(stage_memory_bytes)
        params.stage_memory_context = stage_memory_context
        helps = {"auto": 0, "on": 1, "off": 2}
        if prefill_help not in helps:
            raise ValueError(f"prefill_help {prefill_help!r}: one of auto, on, off")
        params.prefill_help = helps[prefill_help]
        if progress is not None:
            def progress_py(_user, fraction):
                try:
                    return bool(progress(fraction))
                except Exception:
                    return False

            self._progress = _progress_fn(progress_py)  # alive as long as the engine
            params.progress = self._progress
        out = _EngineP()
        # str paths are passed as UTF-8; bytes are passed through (the library
        # rejects invalid UTF-8 with INVALID_ARGUMENT).
        path = os.fsencode(pack)
        _check("strata_engine_load", _lib.strata_engine_load(path, byref(params), byref(out)))
        self._ptr = out
        info = ModelInfoC()
        _check("strata_engine_info", _lib.strata_engine_info(self._ptr, byref(info)))
        self.info = ModelInfo(
            info.vocab_size,
            info.hidden_size,
            info.num_layers,
            info.num_experts,
            info.num_experts_per_tok,
            info.max_context,
            bool(info.has_tokenizer),
        )
        # The tokens that end generation (empty when the checkpoint named none).
        n = c_size_t()
        st = _lib.strata_engine_eos_tokens(self._ptr, None, 0, byref(n))
        if st != Status.BUFFER_TOO_SMALL:
            _check("strata_engine_eos_tokens", st)
        buf = (c_int32 * n.value)()
        _check("strata_engine_eos_tokens", _lib.strata_engine_eos_tokens(self._ptr, buf, n.value, byref(n)))
        self.eos_tokens: Tuple[int, ...] = tuple(buf[: n.value])

    def _handle(self):
        if not self._ptr:
            raise ValueError("the engine is closed")
        return self._ptr

    def session(
        self,
        *,
        context_size: int = 0,
        prefill_chunk: int = 0,
        kv_type: KvType = KvType.AUTO,
        keep_all_logits: bool = False,
    ) -> "Session":
        return Session(self, context_size=context_size, prefill_chunk=prefill_chunk, kv_type=kv_type,
                       keep_all_logits=keep_all_logits)

    def tokenize(self, text: str) -> List[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        n = c_size_t()
        while True:
            buf = (c_int32 * cap)()
            st = _lib.strata_tokenize(self._handle(), data, len(data), buf, cap, byref(n))
            if st == Status.BUFFER_TOO_SMALL:
                cap = n.value
                continue
            _check("strata_tokenize", st)
            return list(buf[: n.value])

    def detokenize(self, tokens: Sequence[int]) -> str:
        toks = (c_int32 * len(tokens))(*tokens)
        cap = 256
        n = c_size_t()
        while True:
            buf = ctypes.create_string_buffer(cap)
            st = _lib.strata_detokenize(self._handle(), toks, len(tokens), buf, cap, byref(n))
            if st == Status.BUFFER_TOO_SMALL:
                cap = n.value  # the bytes needed, NUL included
                continue
            _check("strata_detokenize", st)
            return buf.raw[: n.value].decode("utf-8", "replace")

    def close(self) -> None:
        if self._ptr:
            _lib.strata_engine_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


class Session:
    """One conversation: tokens, KV cache and the last logits."""

    def __init__(self, engine: Engine, *, context_size=0, prefill_chunk=0, kv_type=KvType.AUTO,
                 keep_all_logits=False):
        self._ptr = None
        self.vocab_size = engine.info.vocab_size
        self.eos_tokens = engine.eos_tokens
        params = SessionParams()
        _check("strata_session_default_params", _lib.strata_session_default_params(byref(params), sizeof(params)))
        params.context_size = context_size
        params.prefill_chunk = prefill_chunk
        params.kv_type = int(kv_type)
        params.keep_all_logits = keep_all_logits
        out = _SessionP()
        _check("strata_session_open", _lib.strata_session_open(engine._handle(), byref(params), byref(out)))
        self._ptr = out

    def _handle(self):
        if not self._ptr:
            raise ValueError("the session is closed")
        return self._ptr

    def prefill(self, tokens: Sequence[int]) -> None:
        arr = (c_int32 * len(tokens))(*tokens)
        _check("strata_session_prefill", _lib.strata_session_prefill(self._handle(), arr, len(tokens)))

    def prefill_conversation(self, tokens: Sequence[int]) -> Tuple[int, int]:
        """Makes the session hold exactly `tokens`, the whole conversation so
        far, reusing the longest common prefix it holds and reading only the
        rest. Returns (reused, read)."""
        arr = (c_int32 * len(tokens))(*tokens)
        reused, read = c_size_t(), c_size_t()
        _check(
            "strata_session_prefill_conversation",
            _lib.strata_session_prefill_conversation(self._handle(), arr, len(tokens), byref(reused), byref(read)),
        )
        return reused.value, read.value

    def step(self, sampling: Sampling = GREEDY) -> int:
        """Samples a token from the current logits, appends it and computes
        its logits. The library keeps the sampler (and its random stream)
        across steps while the parameters stay the same."""
        tok = c_int32()
        params = sampling._c()
        _check("strata_session_step", _lib.strata_session_step(self._handle(), byref(params), byref(tok)))
        return tok.value

    def generate(self, n: int, sampling: Sampling = GREEDY, stop_at_eos: bool = True) -> List[int]:
        """Up to n steps; with stop_at_eos, ends before the first of the
        engine's end-of-generation tokens (which is sampled, not returned)."""
        params = sampling._c()
        tok = c_int32()
        out = []
        for _ in range(n):
            _check("strata_session_step", _lib.strata_session_step(self._handle(), byref(params), byref(tok)))
            if stop_at_eos and tok.value in self.eos_tokens:
                break
            out.append(tok.value)
        return out

    def logits(self, index: int = -1) -> List[float]:
        """Logits of a position: -1 the last, -2 the one before...; >= 0 an
        absolute position (those need keep_all_logits)."""
        buf = (c_float * self.vocab_size)()
        n = c_size_t()
        _check("strata_session_logits",
               _lib.strata_session_logits(self._handle(), index, buf, self.vocab_size, byref(n)))
        return list(buf[: n.value])

    @property
    def position(self) -> int:
        out = c_size_t()
        _check("strata_session_position", _lib.strata_session_position(self._handle(), byref(out)))
        return out.value

    def checkpoint(self) -> int:
        out = c_uint64()
        _check("strata_session_checkpoint", _lib.strata_session_checkpoint(self._handle(), byref(out)))
        return out.value

    def rewind(self, checkpoint: int) -> None:
        _check("strata_session_rewind", _lib.strata_session_rewind(self._handle(), checkpoint))

    def release_checkpoint(self, checkpoint: int) -> None:
        """Forgets a checkpoint (each one holds a row of logits until then)."""
        _check("strata_session_checkpoint_release",
               _lib.strata_session_checkpoint_release(self._handle(), checkpoint))

    def rewind_to(self, position: int) -> None:
        _check("strata_session_rewind_to", _lib.strata_session_rewind_to(self._handle(), position))

    def save_state(self) -> bytes:
        size = c_size_t()
        _check("strata_session_state_size", _lib.strata_session_state_size(self._handle(), byref(size)))
        buf = (c_uint8 * size.value)()
        n = c_size_t()
        _check("strata_session_state_save",
               _lib.strata_session_state_save(self._handle(), buf, size.value, byref(n)))
        return bytes(buf[: n.value])

    def load_state(self, data: bytes) -> None:
        buf = (c_uint8 * len(data)).from_buffer_copy(data)
        _check("strata_session_state_load", _lib.strata_session_state_load(self._handle(), buf, len(data)))

    def close(self) -> None:
        if self._ptr:
            _lib.strata_session_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()
