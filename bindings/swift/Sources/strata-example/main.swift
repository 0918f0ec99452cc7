// strata-example PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
// Prints the N generated tokens on stdout as one line of space-separated ids.
import Strata

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

func eprint(_ s: String) { fputs(s + "\n", stderr) }

let args = CommandLine.arguments
guard (5...9).contains(args.count), let n = Int(args[3]), let seed = UInt64(args[4]) else {
    eprint("usage: strata-example PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]")
    exit(2)
}
var sampling = Sampling(seed: seed)
if args.count > 5, let v = Float(args[5]) { sampling.temperature = v }
if args.count > 6, let v = Int32(args[6]) { sampling.topK = v }
if args.count > 7, let v = Float(args[7]) { sampling.topP = v }
if args.count > 8, let v = Float(args[8]) { sampling.minP = v }

do {
    let engine = try Engine(pack: args[1])
    eprint("strata \(version()), C ABI \(abiVersion()), vocab \(engine.info.vocabSize)")
    // Token ids, or text when the pack ships a tokenizer.
    let fields = args[2].split(separator: ",")
    let ids = fields.compactMap { Int32($0) }
    let prompt = try (ids.count == fields.count ? ids : engine.tokenize(args[2]))

    let session = try engine.session()
    try session.prefill(prompt)
    let out = try session.generate(n, sampling)
    print(out.map(String.init).joined(separator: " "))

    // Checkpoint, continue, rewind, continue: the same greedy tokens.
    let cp = try session.checkpoint()
    let first = try session.generate(8)
    try session.rewind(to: cp)
    let again = try session.generate(8)
    guard first == again else {
        eprint("strata-example: the continuation after rewind differs: \(first) vs \(again)")
        exit(1)
    }

    // State into a second session.
    try session.rewind(to: cp)
    let state = try session.saveState()
    let copy = try engine.session()
    try copy.loadState(state)
    guard try copy.generate(8) == first else {
        eprint("strata-example: the session loaded from state continues differently")
        exit(1)
    }
    eprint("checkpoint/rewind and state save/load: same continuation \(first)")
} catch let e as StrataError {
    eprint("strata-example: \(e)")
    exit(1)
} catch {
    eprint("strata-example: \(error)")
    exit(1)
}
