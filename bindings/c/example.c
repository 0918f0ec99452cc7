/* example.c: the whole Strata C API path in one program.
 *
 *   ./example PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
 *
 * Loads a pack, prints the model info (stderr), prefills the prompt, samples
 * N tokens and prints them on stdout as one line of space-separated ids (the
 * same tokens `strata generate` prints for the same arguments). Then it shows
 * state save/load and checkpoint/rewind, checking that each reproduces the
 * same continuation. Every failure prints strata_status_message() and
 * strata_last_error() and exits with status 1.
 *
 * TOKENS is a comma-separated list of token ids; when it is not, and the pack
 * ships a tokenizer, it is tokenized as text instead.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "cli_args.h"

/* Tokens generated after the state load and after the checkpoint. */
#define CONTINUATION 8

/* Reports a failed call; the message of strata_last_error() belongs to this
 * thread and stays valid until its next strata_ call, so print it first. */
static int failed(const char *what, strata_status st)
{
    fprintf(stderr, "example: %s failed: %s (status %d): %s\n", what, strata_status_message(st), (int)st,
            strata_last_error());
    return 0;
}

#define CHECK(call)                                                                                          \
    do {                                                                                                     \
        strata_status st_ = (call);                                                                          \
        if (st_ != STRATA_OK) {                                                                              \
            failed(#call, st_);                                                                              \
            goto done;                                                                                       \
        }                                                                                                    \
    } while (0)

static void on_log(void *user_data, strata_log_level level, const char *message)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    (void)user_data;
    fprintf(stderr, "strata[%s]: %s\n", (unsigned)level < 4 ? names[level] : "?", message);
}

static bool on_progress(void *user_data, float fraction)
{
    int *calls = (int *)user_data;
    (*calls)++;
    (void)fraction;
    return true; /* false would cancel the load (STRATA_ERR_CANCELLED) */
}

/* Steps n times with params, writing the tokens to out. */
static strata_status generate(strata_session *s, const strata_sampling_params *params, int32_t *out, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        strata_status st = strata_session_step(s, params, &out[i]);
        if (st != STRATA_OK)
            return st;
    }
    return STRATA_OK;
}

/* Steps up to n times, as `strata generate` does: ends before the first of
 * the n_eos end-of-generation tokens in eos (the session holds it; out does
 * not). *n_out is the number of tokens written to out. */
static strata_status generate_until_eos(strata_session *s, const strata_sampling_params *params, const int32_t *eos,
                                        size_t n_eos, int32_t *out, size_t n, size_t *n_out)
{
    size_t j;
    for (*n_out = 0; *n_out < n; ++*n_out) {
        strata_status st = strata_session_step(s, params, &out[*n_out]);
        if (st != STRATA_OK)
            return st;
        for (j = 0; j < n_eos; j++)
            if (out[*n_out] == eos[j])
                return STRATA_OK;
    }
    return STRATA_OK;
}

static int same_tokens(const int32_t *a, const int32_t *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

int main(int argc, char **argv)
{
    static struct cli_args args;
    int ok = 0, progress_calls = 0;
    strata_engine *engine = NULL;
    strata_session *session = NULL, *copy = NULL;
    strata_engine_params eparams;
    strata_session_params sparams;
    strata_sampling_params sampling, greedy;
    strata_model_info info;
    int32_t *prompt = NULL, *out = NULL, *eos = NULL;
    size_t n_prompt = 0, n_eos = 0, n_out = 0, pos_before = 0, pos_after = 0, state_size = 0, state_len = 0;
    int32_t cont_a[CONTINUATION], cont_b[CONTINUATION], cont_c[CONTINUATION];
    uint64_t checkpoint = 0;
    uint8_t *state = NULL;
    char *text = NULL;

    if (!cli_parse(argc, argv, 1, &args))
        return 2;
    fprintf(stderr, "strata %s, C ABI %u\n", strata_version(), (unsigned)strata_abi_version());
    CHECK(strata_set_log_callback(on_log, NULL, STRATA_LOG_WARN));

    /* Engine: default params, then override what we need. The library reads
     * only the first struct_size bytes, so this code keeps working with a
     * newer library that appends fields. */
    CHECK(strata_engine_default_params(&eparams, sizeof eparams));
    eparams.progress = on_progress;
    eparams.progress_user_data = &progress_calls;
    CHECK(strata_engine_load(args.pack, &eparams, &engine));

    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK(strata_engine_info(engine, &info));
    fprintf(stderr,
            "model: vocab %u, hidden %u, %u layers, %u experts (top %u), context %u, tokenizer %s; "
            "%d progress calls\n",
            (unsigned)info.vocab_size, (unsigned)info.hidden_size, (unsigned)info.num_layers,
            (unsigned)info.num_experts, (unsigned)info.num_experts_per_tok, (unsigned)info.max_context,
            info.has_tokenizer ? "yes" : "no", progress_calls);

    /* Prompt: token ids, or text when the pack has a tokenizer. */
    if (args.n_tokens > 0) {
        n_prompt = args.n_tokens;
        prompt = malloc(n_prompt * sizeof *prompt);
        if (prompt == NULL)
            goto oom;
        memcpy(prompt, args.tokens, n_prompt * sizeof *prompt);
    } else if (info.has_tokenizer) {
        size_t len = strlen(args.prompt), cap = len + 16;
        strata_status st;
        /* Guess a capacity; BUFFER_TOO_SMALL puts the count needed in n_prompt. */
        prompt = malloc(cap * sizeof *prompt);
        if (prompt == NULL)
            goto oom;
        st = strata_tokenize(engine, args.prompt, len, prompt, cap, &n_prompt);
        if (st == STRATA_ERR_BUFFER_TOO_SMALL) {
            int32_t *bigger = realloc(prompt, n_prompt * sizeof *prompt);
            if (bigger == NULL)
                goto oom;
            prompt = bigger;
            cap = n_prompt;
            st = strata_tokenize(engine, args.prompt, len, prompt, cap, &n_prompt);
        }
        CHECK(st);
        fprintf(stderr, "prompt: %zu tokens from text\n", n_prompt);
    } else {
        fprintf(stderr, "example: \"%s\" is not a token list and the pack has no tokenizer\n", args.prompt);
        goto done;
    }

    CHECK(strata_session_default_params(&sparams, sizeof sparams));
    CHECK(strata_session_open(engine, &sparams, &session));

    CHECK(strata_sampling_default_params(&sampling, sizeof sampling));
    sampling.temperature = args.temperature;
    sampling.top_k = args.top_k;
    sampling.top_p = args.top_p;
    sampling.min_p = args.min_p;
    sampling.seed = args.seed;
    CHECK(strata_sampling_default_params(&greedy, sizeof greedy)); /* temperature 0 */

    /* Prefill, then N steps with the same params: the session keeps the
     * sampler (seeded once) across the steps, like `strata generate`. */
    CHECK(strata_session_prefill(session, prompt, n_prompt));
    out = malloc((args.n > 0 ? args.n : 1) * sizeof *out);
    if (out == NULL)
        goto oom;
    /* The tokens that end generation (none when the checkpoint named
     * none): a size query first, as for every list the library returns. */
    {
        strata_status st = strata_engine_eos_tokens(engine, NULL, 0, &n_eos);
        if (st == STRATA_ERR_BUFFER_TOO_SMALL) {
            eos = malloc(n_eos * sizeof *eos);
            if (eos == NULL)
                goto oom;
            st = strata_engine_eos_tokens(engine, eos, n_eos, &n_eos);
        }
        CHECK(st);
    }
    CHECK(generate_until_eos(session, &sampling, eos, n_eos, out, args.n, &n_out));
    cli_print_tokens(out, n_out);

    if (info.has_tokenizer && n_out > 0) {
        size_t cap = 256, len = 0;
        strata_status st;
        text = malloc(cap);
        if (text == NULL)
            goto oom;
        st = strata_detokenize(engine, out, n_out, text, cap, &len);
        if (st == STRATA_ERR_BUFFER_TOO_SMALL) { /* len = the bytes needed, NUL included */
            char *bigger = realloc(text, len);
            if (bigger == NULL)
                goto oom;
            text = bigger;
            cap = len;
            st = strata_detokenize(engine, out, n_out, text, cap, &len);
        }
        CHECK(st);
        fprintf(stderr, "text: %s\n", text);
    }

    /* State: save it, load it into a second session; both continue with
     * the same sampling params and give the same tokens, because the state
     * holds the tokens, the KV cache, the last logits and the sampler's
     * random stream. */
    CHECK(strata_session_position(session, &pos_before));
    CHECK(strata_session_state_size(session, &state_size));
    state = malloc(state_size > 0 ? state_size : 1);
    if (state == NULL)
        goto oom;
    CHECK(strata_session_state_save(session, state, state_size, &state_len));
    CHECK(strata_session_open(engine, NULL, &copy));
    CHECK(strata_session_state_load(copy, state, state_len));
    CHECK(strata_session_position(copy, &pos_after));
    if (pos_after != pos_before) {
        fprintf(stderr, "example: the loaded session is at %zu, expected %zu\n", pos_after, pos_before);
        goto done;
    }
    CHECK(generate(session, &sampling, cont_a, CONTINUATION));
    CHECK(generate(copy, &sampling, cont_b, CONTINUATION));
    if (!same_tokens(cont_a, cont_b, CONTINUATION)) {
        fprintf(stderr, "example: the session loaded from state continues differently\n");
        goto done;
    }
    fprintf(stderr, "state: %zu bytes; a second session loaded from it continues with the same %d tokens\n",
            state_len, CONTINUATION);

    /* Checkpoint, continue, rewind, continue again: the same tokens. Greedy,
     * because a rewind restores the context (tokens, KV, logits), not the
     * position of the sampler's random stream. */
    CHECK(strata_session_position(session, &pos_before));
    CHECK(strata_session_checkpoint(session, &checkpoint));
    CHECK(generate(session, &greedy, cont_a, CONTINUATION));
    CHECK(strata_session_rewind(session, checkpoint));
    CHECK(strata_session_position(session, &pos_after));
    if (pos_after != pos_before) {
        fprintf(stderr, "example: rewind left position %zu, expected %zu\n", pos_after, pos_before);
        goto done;
    }
    CHECK(generate(session, &greedy, cont_c, CONTINUATION));
    if (!same_tokens(cont_a, cont_c, CONTINUATION)) {
        fprintf(stderr, "example: the continuation after rewind differs from the first one\n");
        goto done;
    }
    CHECK(strata_session_checkpoint_release(session, checkpoint));
    fprintf(stderr, "checkpoint at %zu, rewind: the same %d-token continuation\n", pos_before, CONTINUATION);
    ok = 1;
    goto done;

oom:
    fprintf(stderr, "example: out of memory\n");
done:
    /* Free in any order: sessions keep the model alive. NULL is fine. */
    strata_session_free(copy);
    strata_session_free(session);
    strata_engine_free(engine);
    free(state);
    free(text);
    free(eos);
    free(out);
    free(prompt);
    return ok ? 0 : 1;
}
