// Package strata binds the Strata C API (include/strata.h) with cgo.
//
// An Engine is a loaded pack; it is safe for concurrent use and its sessions
// keep the model alive, so Engine.Close may come before Session.Close. A
// Session is one conversation and must be used by one goroutine at a time
// (the library answers concurrent use with ErrBusy). Every failure is an
// *Error carrying the status and the library's message; errors.Is works
// with the Status values (errors.Is(err, strata.ErrTokenOutOfRange)).
//
// The cgo flags point at the repository's include/ and target/release/ (run
// `cargo build --release` first); the rpath lets tests run in place.
package strata

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -L${SRCDIR}/../../target/release -lstrata -Wl,-rpath,${SRCDIR}/../../target/release
#include <stdlib.h>
#include "strata.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Status is a strata_status code.
type Status int

const (
	OK                 Status = C.STRATA_OK
	ErrInvalidArgument Status = C.STRATA_ERR_INVALID_ARGUMENT
	ErrNullPointer     Status = C.STRATA_ERR_NULL_POINTER
	ErrIO              Status = C.STRATA_ERR_IO
	ErrBadPack         Status = C.STRATA_ERR_BAD_PACK
	ErrUnsupported     Status = C.STRATA_ERR_UNSUPPORTED
	ErrTokenOutOfRange Status = C.STRATA_ERR_TOKEN_OUT_OF_RANGE
	ErrContextOverflow Status = C.STRATA_ERR_CONTEXT_OVERFLOW
	ErrBusy            Status = C.STRATA_ERR_BUSY
	ErrCancelled       Status = C.STRATA_ERR_CANCELLED
	ErrNoCUDA          Status = C.STRATA_ERR_NO_CUDA
	ErrTokenizer       Status = C.STRATA_ERR_TOKENIZER
	ErrBufferTooSmall  Status = C.STRATA_ERR_BUFFER_TOO_SMALL
	ErrNotFound        Status = C.STRATA_ERR_NOT_FOUND
	ErrNonfinite       Status = C.STRATA_ERR_NONFINITE
	ErrInternal        Status = C.STRATA_ERR_INTERNAL
)

// Error returns the library's text for the status.
func (s Status) Error() string {
	return C.GoString(C.strata_status_message(C.strata_status(s)))
}

// Error is a failed call.
type Error struct {
	Func    string // the C function, e.g. "strata_engine_load"
	Status  Status
	Message string // strata_last_error() of the failing call
}

func (e *Error) Error() string {
	if e.Message == "" { // the library's message names the function itself
		return fmt.Sprintf("%s: %v", e.Func, e.Status)
	}
	return fmt.Sprintf("%s (%v)", e.Message, e.Status)
}

// Unwrap makes errors.Is(err, strata.ErrBusy) and friends work.
func (e *Error) Unwrap() error { return e.Status }

// call runs one C call and turns a failure into an *Error. strata_last_error
// is per OS thread, so the goroutine stays on its thread for both calls.
func call(name string, f func() C.strata_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.STRATA_OK {
		return nil
	}
	return &Error{Func: name, Status: Status(st), Message: C.GoString(C.strata_last_error())}
}

// Version is the library's version string.
func Version() string { return C.GoString(C.strata_version()) }

// ABIVersion is the library's C ABI version.
func ABIVersion() uint32 { return uint32(C.strata_abi_version()) }

// ModelInfo describes the loaded model.
type ModelInfo struct {
	VocabSize, HiddenSize, NumLayers, NumExperts, NumExpertsPerTok, MaxContext uint32
	HasTokenizer                                                               bool
}

// EngineOptions are the load options; the zero value loads on the CPU with all cores.
type EngineOptions struct {
	Devices         []string // e.g. {"cpu"} or {"cuda:0"}; nil = cpu
	Threads         uint32   // 0 = all cores
	VerifyChecksums bool
}

// Engine is a loaded pack.
type Engine struct {
	ptr  *C.strata_engine
	Info ModelInfo
	// EOSTokens end generation (empty when the checkpoint named none).
	EOSTokens []int32
}

// Load loads the pack at path.
func Load(path string, opts *EngineOptions) (*Engine, error) {
	var p C.strata_engine_params
	if err := call("strata_engine_default_params", func() C.strata_status {
		return C.strata_engine_default_params(&p, C.uint32_t(unsafe.Sizeof(p)))
	}); err != nil {
		return nil, err
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var devs **C.char
	if opts != nil {
		p.n_threads = C.uint32_t(opts.Threads)
		p.verify_checksums = C.bool(opts.VerifyChecksums)
		if len(opts.Devices) > 0 {
			// The list lives in C memory: cgo forbids passing C a Go
			// pointer to memory holding Go pointers.
			n := len(opts.Devices) + 1
			devs = (**C.char)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(uintptr(0)))))
			list := unsafe.Slice(devs, n)
			for i, d := range opts.Devices {
				list[i] = C.CString(d)
			}
			defer func() {
				for _, s := range list {
					C.free(unsafe.Pointer(s))
				}
				C.free(unsafe.Pointer(devs))
			}()
			p.devices = devs
		}
	}
	e := &Engine{}
	if err := call("strata_engine_load", func() C.strata_status {
		return C.strata_engine_load(cpath, &p, &e.ptr)
	}); err != nil {
		return nil, err
	}
	var info C.strata_model_info
	info.struct_size = C.uint32_t(unsafe.Sizeof(info))
	if err := call("strata_engine_info", func() C.strata_status { return C.strata_engine_info(e.ptr, &info) }); err != nil {
		C.strata_engine_free(e.ptr)
		return nil, err
	}
	e.Info = ModelInfo{
		VocabSize: uint32(info.vocab_size), HiddenSize: uint32(info.hidden_size), NumLayers: uint32(info.num_layers),
		NumExperts: uint32(info.num_experts), NumExpertsPerTok: uint32(info.num_experts_per_tok),
		MaxContext: uint32(info.max_context), HasTokenizer: bool(info.has_tokenizer),
	}
	var n C.size_t
	err := call("strata_engine_eos_tokens", func() C.strata_status { return C.strata_engine_eos_tokens(e.ptr, nil, 0, &n) })
	if se, ok := err.(*Error); ok && se.Status == ErrBufferTooSmall {
		e.EOSTokens = make([]int32, int(n))
		err = call("strata_engine_eos_tokens", func() C.strata_status {
			return C.strata_engine_eos_tokens(e.ptr, (*C.int32_t)(unsafe.Pointer(&e.EOSTokens[0])), n, &n)
		})
	}
	if err != nil {
		C.strata_engine_free(e.ptr)
		return nil, err
	}
	runtime.SetFinalizer(e, (*Engine).Close)
	return e, nil
}

// Close frees the engine; open sessions keep working. Safe to call twice.
func (e *Engine) Close() error {
	if e.ptr != nil {
		C.strata_engine_free(e.ptr)
		e.ptr = nil
		runtime.SetFinalizer(e, nil)
	}
	return nil
}

// Tokenize encodes text with the pack's tokenizer (ErrTokenizer without one).
func (e *Engine) Tokenize(text string) ([]int32, error) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	toks := make([]int32, len(text)+16)
	for {
		var n C.size_t
		err := call("strata_tokenize", func() C.strata_status {
			return C.strata_tokenize(e.ptr, ctext, C.size_t(len(text)), (*C.int32_t)(unsafe.Pointer(&toks[0])),
				C.size_t(len(toks)), &n)
		})
		if se, ok := err.(*Error); ok && se.Status == ErrBufferTooSmall {
			toks = make([]int32, int(n))
			continue
		}
		if err != nil {
			return nil, err
		}
		return toks[:int(n)], nil
	}
}

// Detokenize decodes tokens to text.
func (e *Engine) Detokenize(tokens []int32) (string, error) {
	if len(tokens) == 0 {
		return "", nil
	}
	buf := make([]byte, 256)
	for {
		var n C.size_t
		err := call("strata_detokenize", func() C.strata_status {
			return C.strata_detokenize(e.ptr, (*C.int32_t)(unsafe.Pointer(&tokens[0])), C.size_t(len(tokens)),
				(*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n)
		})
		if se, ok := err.(*Error); ok && se.Status == ErrBufferTooSmall {
			buf = make([]byte, int(n)) // the bytes needed, NUL included
			continue
		}
		if err != nil {
			return "", err
		}
		return string(buf[:int(n)]), nil
	}
}

// KVType is the session's KV cache element type.
type KVType int

const (
	KVAuto KVType = C.STRATA_KV_AUTO
	KVF32  KVType = C.STRATA_KV_F32
	KVBF16 KVType = C.STRATA_KV_BF16
	KVInt8 KVType = C.STRATA_KV_INT8
)

// SessionOptions; the zero value is the library's defaults.
type SessionOptions struct {
	ContextSize   uint32 // 0 = the model's maximum
	PrefillChunk  uint32 // 0 = the whole prompt in one forward
	KV            KVType
	KeepAllLogits bool
}

// Session is one conversation. Use it from one goroutine at a time.
type Session struct {
	ptr   *C.strata_session
	vocab uint32
	eos   []int32
}

// NewSession opens a session on the engine.
func (e *Engine) NewSession(opts *SessionOptions) (*Session, error) {
	var p C.strata_session_params
	if err := call("strata_session_default_params", func() C.strata_status {
		return C.strata_session_default_params(&p, C.uint32_t(unsafe.Sizeof(p)))
	}); err != nil {
		return nil, err
	}
	if opts != nil {
		p.context_size = C.uint32_t(opts.ContextSize)
		p.prefill_chunk = C.uint32_t(opts.PrefillChunk)
		p.kv_type = C.strata_kv_type(opts.KV)
		p.keep_all_logits = C.bool(opts.KeepAllLogits)
	}
	s := &Session{vocab: e.Info.VocabSize, eos: append([]int32(nil), e.EOSTokens...)}
	if err := call("strata_session_open", func() C.strata_status { return C.strata_session_open(e.ptr, &p, &s.ptr) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(s, (*Session).Close)
	return s, nil
}

// Close frees the session. Safe to call twice.
func (s *Session) Close() error {
	if s.ptr != nil {
		C.strata_session_free(s.ptr)
		s.ptr = nil
		runtime.SetFinalizer(s, nil)
	}
	return nil
}

// Prefill appends tokens and computes the logits of the last one.
func (s *Session) Prefill(tokens []int32) error {
	var p *C.int32_t
	if len(tokens) > 0 {
		p = (*C.int32_t)(unsafe.Pointer(&tokens[0]))
	} else {
		p = new(C.int32_t) // a valid pointer; the library rejects the empty prompt
	}
	return call("strata_session_prefill", func() C.strata_status {
		return C.strata_session_prefill(s.ptr, p, C.size_t(len(tokens)))
	})
}

// PrefillConversation makes the session hold exactly tokens, the whole
// conversation so far, reusing the longest common prefix it already holds
// (from a checkpoint on models with recurrent state) and reading only the
// rest. It returns how many tokens were reused and how many were read.
func (s *Session) PrefillConversation(tokens []int32) (reused, read int, err error) {
	var p *C.int32_t
	if len(tokens) > 0 {
		p = (*C.int32_t)(unsafe.Pointer(&tokens[0]))
	} else {
		p = new(C.int32_t) // a valid pointer; the library rejects the empty conversation
	}
	var cReused, cRead C.size_t
	err = call("strata_session_prefill_conversation", func() C.strata_status {
		return C.strata_session_prefill_conversation(s.ptr, p, C.size_t(len(tokens)), &cReused, &cRead)
	})
	return int(cReused), int(cRead), err
}

// Sampling parameters. The zero value is greedy.
type Sampling struct {
	Temperature float32 // 0 = greedy
	TopK        int32   // 0 = off
	TopP        float32 // 0 or 1 = off (the C API's off value is 1)
	MinP        float32 // 0 = off
	Seed        uint64
}

// Greedy is argmax sampling.
var Greedy = Sampling{}

func (sp Sampling) c() (C.strata_sampling_params, error) {
	var p C.strata_sampling_params
	err := call("strata_sampling_default_params", func() C.strata_status {
		return C.strata_sampling_default_params(&p, C.uint32_t(unsafe.Sizeof(p)))
	})
	p.temperature = C.float(sp.Temperature)
	p.top_k = C.int32_t(sp.TopK)
	if sp.TopP != 0 {
		p.top_p = C.float(sp.TopP)
	}
	p.min_p = C.float(sp.MinP)
	p.seed = C.uint64_t(sp.Seed)
	return p, err
}

// Step samples the next token, appends it and computes its logits. The
// library keeps the sampler's random stream across steps while the
// parameters stay the same.
func (s *Session) Step(sp Sampling) (int32, error) {
	p, err := sp.c()
	if err != nil {
		return 0, err
	}
	var tok C.int32_t
	err = call("strata_session_step", func() C.strata_status { return C.strata_session_step(s.ptr, &p, &tok) })
	return int32(tok), err
}

// Generate steps up to n times, ending before the first of the engine's
// EOSTokens (which is sampled, not returned).
func (s *Session) Generate(n int, sp Sampling) ([]int32, error) {
	return s.generate(n, sp, s.eos)
}

// GenerateAll steps n times, past any end-of-generation token.
func (s *Session) GenerateAll(n int, sp Sampling) ([]int32, error) {
	return s.generate(n, sp, nil)
}

func (s *Session) generate(n int, sp Sampling, eos []int32) ([]int32, error) {
	out := make([]int32, 0, n)
	for i := 0; i < n; i++ {
		t, err := s.Step(sp)
		if err != nil {
			return out, err
		}
		if contains(eos, t) {
			break
		}
		out = append(out, t)
	}
	return out, nil
}

// contains reports whether t is in ids (go 1.19 has no slices package).
func contains(ids []int32, t int32) bool {
	for _, id := range ids {
		if id == t {
			return true
		}
	}
	return false
}

// Logits of a position: -1 the last, -2 the one before...; >= 0 absolute.
func (s *Session) Logits(index int64) ([]float32, error) {
	buf := make([]float32, s.vocab)
	var n C.size_t
	err := call("strata_session_logits", func() C.strata_status {
		return C.strata_session_logits(s.ptr, C.int64_t(index), (*C.float)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n)
	})
	if err != nil {
		return nil, err
	}
	return buf[:int(n)], nil
}

// Position is the number of tokens in the context.
func (s *Session) Position() (int, error) {
	var n C.size_t
	err := call("strata_session_position", func() C.strata_status { return C.strata_session_position(s.ptr, &n) })
	return int(n), err
}

// Checkpoint marks the current position.
func (s *Session) Checkpoint() (uint64, error) {
	var id C.uint64_t
	err := call("strata_session_checkpoint", func() C.strata_status { return C.strata_session_checkpoint(s.ptr, &id) })
	return uint64(id), err
}

// Rewind returns to a checkpoint.
func (s *Session) Rewind(checkpoint uint64) error {
	return call("strata_session_rewind", func() C.strata_status {
		return C.strata_session_rewind(s.ptr, C.uint64_t(checkpoint))
	})
}

// ReleaseCheckpoint forgets a checkpoint (each holds a row of logits until then).
func (s *Session) ReleaseCheckpoint(checkpoint uint64) error {
	return call("strata_session_checkpoint_release", func() C.strata_status {
		return C.strata_session_checkpoint_release(s.ptr, C.uint64_t(checkpoint))
	})
}

// RewindTo keeps the first position tokens.
func (s *Session) RewindTo(position int) error {
	return call("strata_session_rewind_to", func() C.strata_status {
		return C.strata_session_rewind_to(s.ptr, C.size_t(position))
	})
}

// SaveState returns the session's state (tokens, KV, last logits).
func (s *Session) SaveState() ([]byte, error) {
	var size C.size_t
	if err := call("strata_session_state_size", func() C.strata_status {
		return C.strata_session_state_size(s.ptr, &size)
	}); err != nil {
		return nil, err
	}
	buf := make([]byte, int(size)+1) // +1: never take &buf[0] of an empty slice
	var n C.size_t
	err := call("strata_session_state_save", func() C.strata_status {
		return C.strata_session_state_save(s.ptr, (*C.uint8_t)(unsafe.Pointer(&buf[0])), size, &n)
	})
	if err != nil {
		return nil, err
	}
	return buf[:int(n)], nil
}

// LoadState replaces the session's state with one saved from a session of
// the same model.
func (s *Session) LoadState(state []byte) error {
	buf := append(state[:len(state):len(state)], 0) // a copy with a valid &buf[0]
	return call("strata_session_state_load", func() C.strata_status {
		return C.strata_session_state_load(s.ptr, (*C.uint8_t)(unsafe.Pointer(&buf[0])), C.size_t(len(state)))
	})
}
