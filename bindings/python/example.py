#!/usr/bin/env python3
"""example.py: the Strata C API from Python (ctypes).

    python3 example.py PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]

Prints the N generated tokens on stdout as one line of space-separated ids
(the same tokens `strata generate` prints for the same arguments), then shows
checkpoint/rewind and state save/load on stderr. TOKENS is a comma-separated
list of token ids, or text when the pack ships a tokenizer.
"""

import sys

import strata


def expect(cond, what):
    """Like assert, but not switched off by python -O."""
    if not cond:
        raise SystemExit(f"example.py: check failed: {what}")


def main(argv):
    if not 5 <= len(argv) <= 9:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    pack, prompt, n, seed = argv[1], argv[2], int(argv[3]), int(argv[4])
    rest = argv[5:] + [None] * 4
    sampling = strata.Sampling(
        temperature=float(rest[0] or 0.0),
        top_k=int(rest[1] or 0),
        top_p=float(rest[2] or 1.0),
        min_p=float(rest[3] or 0.0),
        seed=seed,
    )
    print(f"strata {strata.version()}, C ABI {strata.abi_version()}", file=sys.stderr)

    with strata.Engine(pack) as engine:
        print(f"model: {engine.info}, end-of-generation tokens {list(engine.eos_tokens)}", file=sys.stderr)
        try:
            tokens = [int(t) for t in prompt.split(",")]
        except ValueError:
            tokens = engine.tokenize(prompt)  # raises StrataError(TOKENIZER) without one
            print(f"prompt: {len(tokens)} tokens from text", file=sys.stderr)

        with engine.session() as s:
            s.prefill(tokens)
            out = s.generate(n, sampling)
            print(" ".join(map(str, out)))
            sys.stdout.flush()
            if engine.info.has_tokenizer:
                print(f"text: {engine.detokenize(out)}", file=sys.stderr)

            # State (tokens, KV, logits and the sampler's random stream) into a
            # second session: both continue with the same sampled tokens.
            state = s.save_state()
            with engine.session() as copy:
                copy.load_state(state)
                expect(copy.position == s.position, "position after state load")
                expect(copy.logits() == s.logits(), "logits after state load")
                expect(copy.generate(8, sampling) == s.generate(8, sampling), "continuation after state load")
            print(f"state: {len(state)} bytes, a second session continues the same way", file=sys.stderr)

            # The whole conversation into a fresh session: nothing to reuse, all
            # read; the same conversation again: all reused; logits as after a
            # plain prefill of the same tokens.
            whole = tokens + out
            if len(whole) > 2:  # (generation may end at once on an end-of-generation token)
                with engine.session() as conv:
                    expect(conv.prefill_conversation(whole[:-2]) == (0, len(whole) - 2), "first conversation")
                    expect(conv.prefill_conversation(whole) == (len(whole) - 2, 2), "conversation extended by 2")
                    with engine.session() as plain:
                        plain.prefill(whole)
                        expect(conv.logits() == plain.logits(), "logits after prefix reuse")
                print("prefill_conversation: the prefix is reused, the counts add up", file=sys.stderr)

            # Checkpoint, continue, rewind, continue: the same (greedy) tokens;
            # a rewind does not rewind the sampler's random stream.
            at = s.position
            cp = s.checkpoint()
            first = s.generate(8)
            s.rewind(cp)
            expect(s.position == at, "position after rewind")
            again = s.generate(8)
            expect(first == again, f"continuation after rewind: {again} vs {first}")
            s.release_checkpoint(cp)
            print(f"checkpoint at {at}, rewind: same continuation {first}", file=sys.stderr)

        # generate() ends before an end-of-generation token (the engine's,
        # here one given to the session: the first new token of `out`).
        k = next((i for i in range(1, len(out)) if out[i] not in out[:i]), 0)
        if out:
            with engine.session() as s:
                s.eos_tokens = (out[k],)
                s.prefill(tokens)
                stopped = s.generate(n, sampling)
                expect(stopped == out[:k], f"stop at {out[k]}: {stopped} vs {out[:k]}")
                print(f"end-of-generation token {out[k]}: stopped after {k} tokens", file=sys.stderr)

        # Errors carry the status and the library's message.
        with engine.session() as s:
            try:
                s.prefill([engine.info.vocab_size])
            except strata.StrataError as e:
                expect(e.status == strata.Status.TOKEN_OUT_OF_RANGE, str(e))
                expect(s.position == 0, "position after a rejected prefill")
                print(f"as expected: {e}", file=sys.stderr)
            else:
                expect(False, "an out-of-range token was accepted")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except strata.StrataError as e:
        print(f"example.py: {e}", file=sys.stderr)
        sys.exit(1)
