// A thin Swift layer over the Strata C API: classes that free their handle
// in deinit, errors thrown as StrataError (status + the library's message).
import CStrata

public struct StrataError: Error, CustomStringConvertible {
    /// The strata_status value.
    public let status: Int
    /// The C function that failed.
    public let function: String
    /// strata_last_error() of the failing call.
    public let message: String

    public var statusMessage: String {
        String(cString: strata_status_message(strata_status(rawValue: numericCast(status))))
    }

    public var description: String { "\(function): \(statusMessage) (status \(status)): \(message)" }
}

@inline(__always)
func check(_ function: String, _ st: strata_status) throws {
    if st != STRATA_OK {
        // Per-thread, valid until the next strata_ call on this thread.
        let message = String(cString: strata_last_error())
        throw StrataError(status: Int(st.rawValue), function: function, message: message)
    }
}

/// struct_size for a C params struct: C's sizeof is Swift's stride.
func structSize<T>(_: T.Type) -> UInt32 { UInt32(MemoryLayout<T>.stride) }

public func version() -> String { String(cString: strata_version()) }
public func abiVersion() -> UInt32 { strata_abi_version() }

public struct Sampling {
    public var temperature: Float = 0  // 0 = greedy
    public var topK: Int32 = 0         // 0 = off
    public var topP: Float = 1         // 1 = off
    public var minP: Float = 0         // 0 = off
    public var seed: UInt64 = 0

    public init(temperature: Float = 0, topK: Int32 = 0, topP: Float = 1, minP: Float = 0, seed: UInt64 = 0) {
        self.temperature = temperature
        self.topK = topK
        self.topP = topP
        self.minP = minP
        self.seed = seed
    }

    public static let greedy = Sampling()

    func c() throws -> strata_sampling_params {
        var p = strata_sampling_params()
        try check("strata_sampling_default_params",
                  strata_sampling_default_params(&p, structSize(strata_sampling_params.self)))
        p.temperature = temperature
        p.top_k = topK
        p.top_p = topP
        p.min_p = minP
        p.seed = seed
        return p
    }
}

public struct ModelInfo {
    public let vocabSize: Int
    public let hiddenSize: Int
    public let numLayers: Int
    public let numExperts: Int
    public let numExpertsPerTok: Int
    public let maxContext: Int
    public let hasTokenizer: Bool
}

/// A loaded pack. Thread-safe; sessions keep the model alive.
public final class Engine {
    let handle: OpaquePointer
    public let info: ModelInfo
    /// The tokens that end generation (empty when the checkpoint named none).
    public let eosTokens: [Int32]

    public init(pack: String, threads: UInt32 = 0) throws {
        var params = strata_engine_params()
        try check("strata_engine_default_params",
                  strata_engine_default_params(&params, structSize(strata_engine_params.self)))
        params.n_threads = threads
        var out: OpaquePointer? = nil
        try check("strata_engine_load", strata_engine_load(pack, &params, &out))
        let engine = out!
        var c = strata_model_info()
        c.struct_size = structSize(strata_model_info.self)
        var st = strata_engine_info(engine, &c)
        var function = "strata_engine_info"
        var eos = [Int32]()
        if st == STRATA_OK {
            function = "strata_engine_eos_tokens"
            var n = 0
            st = strata_engine_eos_tokens(engine, nil, 0, &n)
            if st == STRATA_ERR_BUFFER_TOO_SMALL {  // n = the count
                eos = [Int32](repeating: 0, count: n)
                let cap = n
                st = strata_engine_eos_tokens(engine, &eos, cap, &n)
            }
        }
        if st != STRATA_OK {
            let message = String(cString: strata_last_error())
            strata_engine_free(engine)  // deinit does not run for a failed init
            throw StrataError(status: Int(st.rawValue), function: function, message: message)
        }
        handle = engine
        eosTokens = eos
        info = ModelInfo(vocabSize: Int(c.vocab_size), hiddenSize: Int(c.hidden_size), numLayers: Int(c.num_layers),
                         numExperts: Int(c.num_experts), numExpertsPerTok: Int(c.num_experts_per_tok),
                         maxContext: Int(c.max_context), hasTokenizer: c.has_tokenizer)
    }

    deinit { strata_engine_free(handle) }

    public func session(contextSize: UInt32 = 0) throws -> Session {
        try Session(engine: self, contextSize: contextSize)
    }

    public func tokenize(_ text: String) throws -> [Int32] {
        let bytes = Array(text.utf8)
        var cap = bytes.count + 16
        var n = 0
        while true {
            var tokens = [Int32](repeating: 0, count: cap)
            let st = bytes.withUnsafeBufferPointer { b in
                b.withMemoryRebound(to: CChar.self) { c in
                    strata_tokenize(handle, c.baseAddress, c.count, &tokens, cap, &n)
                }
            }
            if st == STRATA_ERR_BUFFER_TOO_SMALL {  // n = the count needed
                cap = n
                continue
            }
            try check("strata_tokenize", st)
            return Array(tokens[0..<n])
        }
    }

    public func detokenize(_ tokens: [Int32]) throws -> String {
        var cap = 256
        var n = 0
        while true {
            var buf = [CChar](repeating: 0, count: cap)
            let st = strata_detokenize(handle, tokens, tokens.count, &buf, cap, &n)
            if st == STRATA_ERR_BUFFER_TOO_SMALL {  // n = the bytes needed, NUL included
                cap = n
                continue
            }
            try check("strata_detokenize", st)
            return String(cString: buf)
        }
    }
}

/// One conversation; use it from one thread at a time.
public final class Session {
    let handle: OpaquePointer
    let vocab: Int
    let eos: [Int32]

    init(engine: Engine, contextSize: UInt32) throws {
        var params = strata_session_params()
        try check("strata_session_default_params",
                  strata_session_default_params(&params, structSize(strata_session_params.self)))
        params.context_size = contextSize
        var out: OpaquePointer? = nil
        try check("strata_session_open", strata_session_open(engine.handle, &params, &out))
        handle = out!
        vocab = engine.info.vocabSize
        eos = engine.eosTokens
    }

    deinit { strata_session_free(handle) }

    public func prefill(_ tokens: [Int32]) throws {
        try check("strata_session_prefill", strata_session_prefill(handle, tokens, tokens.count))
    }

    /// Makes the session hold exactly `tokens`, the whole conversation so far,
    /// reusing the longest common prefix it holds and reading only the rest.
    /// Returns how many tokens were reused and how many were read.
    @discardableResult
    public func prefillConversation(_ tokens: [Int32]) throws -> (reused: Int, read: Int) {
        var reused = 0
        var read = 0
        try check("strata_session_prefill_conversation",
                  strata_session_prefill_conversation(handle, tokens, tokens.count, &reused, &read))
        return (reused, read)
    }

    /// Samples a token, appends it and computes its logits. The library keeps
    /// the sampler's random stream across steps while the parameters stay equal.
    public func step(_ sampling: Sampling = .greedy) throws -> Int32 {
        var params = try sampling.c()
        var token: Int32 = 0
        try check("strata_session_step", strata_session_step(handle, &params, &token))
        return token
    }

    /// Up to `n` steps, ending before the first of the engine's `eosTokens`
    /// (which is sampled, not returned) unless `stopAtEOS` is false.
    public func generate(_ n: Int, _ sampling: Sampling = .greedy, stopAtEOS: Bool = true) throws -> [Int32] {
        var out = [Int32]()
        for _ in 0..<n {
            let token = try step(sampling)
            if stopAtEOS && eos.contains(token) { break }
            out.append(token)
        }
        return out
    }

    public func logits(_ index: Int64 = -1) throws -> [Float] {
        var buf = [Float](repeating: 0, count: vocab)
        var n = 0
        let cap = buf.count  // not read inside the call that holds &buf
        try check("strata_session_logits", strata_session_logits(handle, index, &buf, cap, &n))
        return Array(buf[0..<n])
    }

    public var position: Int {
        get throws {
            var n = 0
            try check("strata_session_position", strata_session_position(handle, &n))
            return n
        }
    }

    public func checkpoint() throws -> UInt64 {
        var id: UInt64 = 0
        try check("strata_session_checkpoint", strata_session_checkpoint(handle, &id))
        return id
    }

    public func rewind(to checkpoint: UInt64) throws {
        try check("strata_session_rewind", strata_session_rewind(handle, checkpoint))
    }

    public func releaseCheckpoint(_ checkpoint: UInt64) throws {
        try check("strata_session_checkpoint_release", strata_session_checkpoint_release(handle, checkpoint))
    }

    public func rewind(toPosition position: Int) throws {
        try check("strata_session_rewind_to", strata_session_rewind_to(handle, position))
    }

    public func saveState() throws -> [UInt8] {
        var size = 0
        try check("strata_session_state_size", strata_session_state_size(handle, &size))
        var buf = [UInt8](repeating: 0, count: max(size, 1))
        var n = 0
        try check("strata_session_state_save", strata_session_state_save(handle, &buf, size, &n))
        return Array(buf[0..<n])
    }

    public func loadState(_ state: [UInt8]) throws {
        try check("strata_session_state_load", strata_session_state_load(handle, state, state.count))
    }
}
