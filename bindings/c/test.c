/* test.c: the boundary behaviours of the Strata C API as a C caller sees
 * them, checked with asserts that stay on under NDEBUG.
 *
 *   ./test PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
 *
 * Runs every check, then prints the N tokens generated from TOKENS with the
 * given sampling on stdout (one line, like the other examples) so that the
 * caller can compare them with `strata generate`. Exits 1 if any check
 * failed. Optional environment:
 *   STRATA_TOKENIZER_PACK  a second pack, of another model, that ships a
 *                          tokenizer: tokenize/detokenize and cross-model
 *                          state checks run on it
 *   STRATA_TEST_CYCLES     load/free cycles of the leak check (default 20;
 *                          run the program under valgrind to see leaks)
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "cli_args.h"

static int checks, failures;

#define EXPECT(cond)                                                                                         \
    do {                                                                                                     \
        checks++;                                                                                            \
        if (!(cond)) {                                                                                       \
            failures++;                                                                                      \
            fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond);                               \
        }                                                                                                    \
    } while (0)

/* The call must return `want`; a failure must also leave a message. */
#define EXPECT_STATUS(call, want) expect_status((call), (want), #call, __LINE__)

static void expect_status(strata_status got, strata_status want, const char *call, int line)
{
    /* Read the thread's message before any other strata_ call. */
    const char *msg = strata_last_error();
    checks++;
    if (got != want) {
        failures++;
        fprintf(stderr, "%s:%d: FAILED: %s returned %d (%s), expected %d (%s); last error: %s\n", __FILE__, line,
                call, (int)got, strata_status_message(got), (int)want, strata_status_message(want), msg);
    } else if (want != STRATA_OK && (msg == NULL || msg[0] == '\0')) {
        failures++;
        fprintf(stderr, "%s:%d: FAILED: %s returned %s but strata_last_error() is empty\n", __FILE__, line, call,
                strata_status_message(got));
    }
}

/* Fatal: a call the rest of the checks depend on. */
#define REQUIRE_OK(call)                                                                                     \
    do {                                                                                                     \
        strata_status st_ = (call);                                                                          \
        if (st_ != STRATA_OK) {                                                                              \
            fprintf(stderr, "%s:%d: FATAL: %s: %s: %s\n", __FILE__, __LINE__, #call, strata_status_message(st_), \
                    strata_last_error());                                                                    \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static struct cli_args args;
static uint32_t vocab;

static size_t position(strata_session *s)
{
    size_t pos = (size_t)-1;
    REQUIRE_OK(strata_session_position(s, &pos));
    return pos;
}

static strata_session *open_prefilled(strata_engine *e)
{
    strata_session *s = NULL;
    REQUIRE_OK(strata_session_open(e, NULL, &s));
    REQUIRE_OK(strata_session_prefill(s, args.tokens, args.n_tokens));
    return s;
}

static void greedy_tokens(strata_session *s, int32_t *out, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        REQUIRE_OK(strata_session_step(s, NULL, &out[i]));
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char v)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (p[i] != v)
            return 0;
    return 1;
}

/* ---- versions, messages, the function table ---- */

static void test_versions(void)
{
    const strata_api *api = NULL;
    int s;

    EXPECT(strata_abi_version() == STRATA_ABI_VERSION);
    EXPECT(strata_version() != NULL && strata_version()[0] != '\0');
    for (s = STRATA_OK; s <= STRATA_ERR_INTERNAL; s++) {
        const char *m = strata_status_message((strata_status)s);
        EXPECT(m != NULL && m[0] != '\0' && strcmp(m, "unknown status") != 0);
    }
    EXPECT(strcmp(strata_status_message((strata_status)99), "unknown status") == 0);
    EXPECT(strcmp(strata_status_message((strata_status)-1), "unknown status") == 0);
    EXPECT(strata_last_error() != NULL);

    EXPECT_STATUS(strata_get_api(STRATA_ABI_VERSION, &api), STRATA_OK);
    EXPECT(api != NULL && api->abi_version == STRATA_ABI_VERSION && api->struct_size == sizeof(strata_api));
    EXPECT(api != NULL && api->session_step == strata_session_step && api->abi_version_fn() == STRATA_ABI_VERSION);
    EXPECT_STATUS(strata_get_api(2, &api), STRATA_ERR_UNSUPPORTED);
    EXPECT(api == NULL);
    EXPECT_STATUS(strata_get_api(0, &api), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(strata_get_api(1, NULL), STRATA_ERR_NULL_POINTER);
}

/* ---- NULL arguments: STRATA_ERR_NULL_POINTER, nothing changes ---- */

static void test_null_pointers(strata_engine *e)
{
    strata_engine *e2 = NULL;
    strata_session *s = open_prefilled(e), *s2 = NULL;
    strata_model_info info;
    strata_engine_params ep;
    strata_session_params sp;
    strata_sampling_params smp;
    float logits[8];
    uint8_t state[8];
    int32_t tok = -1;
    size_t n = 0, pos = position(s);
    uint64_t id = 0;
    char text[8];

    info.struct_size = sizeof info;
    EXPECT_STATUS(strata_engine_load(NULL, NULL, &e2), STRATA_ERR_NULL_POINTER);
    EXPECT(e2 == NULL);
    EXPECT_STATUS(strata_engine_load(args.pack, NULL, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_engine_default_params(NULL, sizeof ep), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_default_params(NULL, sizeof sp), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_sampling_default_params(NULL, sizeof smp), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_engine_info(NULL, &info), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_engine_info(e, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_open(NULL, NULL, &s2), STRATA_ERR_NULL_POINTER);
    EXPECT(s2 == NULL);
    EXPECT_STATUS(strata_session_open(e, NULL, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_prefill(NULL, args.tokens, args.n_tokens), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_prefill(s, NULL, 3), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_step(NULL, NULL, &tok), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_step(s, NULL, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_logits(NULL, -1, logits, 8, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_logits(s, -1, NULL, 8, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_logits(s, -1, logits, 8, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_position(NULL, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_position(s, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_checkpoint(NULL, &id), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_checkpoint(s, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_rewind(NULL, 0), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_rewind_to(NULL, 0), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_size(NULL, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_size(s, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_save(NULL, state, sizeof state, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_save(s, NULL, sizeof state, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_save(s, state, sizeof state, NULL), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_load(NULL, state, sizeof state), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_session_state_load(s, NULL, sizeof state), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_tokenize(NULL, "a", 1, &tok, 1, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_tokenize(e, NULL, 1, &tok, 1, &n), STRATA_ERR_NULL_POINTER);
    EXPECT_STATUS(strata_detokenize(NULL, &tok, 1, text, sizeof text, &n), STRATA_ERR_NULL_POINTER);
    EXPECT(position(s) == pos);
    strata_session_free(s);
}

/* ---- struct_size: older callers, and what the library writes ---- */

/* What a caller compiled against an older header would have: the leading
 * fields only. */
typedef struct {
    uint32_t struct_size;
    float temperature;
    int32_t top_k;
    float top_p;
} old_sampling_params;
typedef struct {
    uint32_t struct_size;
    uint32_t context_size;
    uint32_t prefill_chunk;
} old_session_params;
typedef struct {
    uint32_t struct_size;
    const char *const *devices;
} old_engine_params;
/* They are prefixes of today's structs (C99 static assertions). */
typedef char old_sampling_is_prefix[sizeof(old_sampling_params) == offsetof(strata_sampling_params, min_p) ? 1 : -1];
typedef char old_session_is_prefix[sizeof(old_session_params) == offsetof(strata_session_params, kv_type) ? 1 : -1];
typedef char old_engine_is_prefix[sizeof(old_engine_params) == offsetof(strata_engine_params, n_threads) ? 1 : -1];

static void test_struct_size(strata_engine *e)
{
    union {
        strata_sampling_params p;
        unsigned char b[sizeof(strata_sampling_params) + 16];
    } smp;
    union {
        strata_session_params p;
        unsigned char b[sizeof(strata_session_params) + 16];
    } ssp;
    union {
        strata_engine_params p;
        unsigned char b[sizeof(strata_engine_params) + 16];
    } eng;
    union {
        strata_model_info p;
        unsigned char b[sizeof(strata_model_info) + 16];
    } inf;
    const uint32_t old_sampling = offsetof(strata_sampling_params, min_p); /* before min_p and seed */
    const uint32_t old_session = offsetof(strata_session_params, kv_type);
    const uint32_t old_engine = offsetof(strata_engine_params, n_threads);
    const uint32_t old_info = offsetof(strata_model_info, hidden_size);
    strata_sampling_params full;
    old_sampling_params *older;
    old_session_params *older_sp;
    old_engine_params *older_ep;
    strata_engine *e2 = NULL;
    strata_session *s = NULL;
    int32_t want[8], got[8], overflow[17];
    uint32_t size;
    size_t i;

    /* default_params writes only the struct_size bytes the caller has. */
    memset(smp.b, 0xAB, sizeof smp.b);
    EXPECT_STATUS(strata_sampling_default_params(&smp.p, old_sampling), STRATA_OK);
    EXPECT(smp.p.struct_size == old_sampling && smp.p.temperature == 0.0f && smp.p.top_p == 1.0f);
    EXPECT(all_bytes(smp.b + old_sampling, sizeof smp.b - old_sampling, 0xAB));
    memset(ssp.b, 0xAB, sizeof ssp.b);
    EXPECT_STATUS(strata_session_default_params(&ssp.p, old_session), STRATA_OK);
    EXPECT(ssp.p.struct_size == old_session && ssp.p.context_size == 0);
    EXPECT(all_bytes(ssp.b + old_session, sizeof ssp.b - old_session, 0xAB));
    memset(eng.b, 0xAB, sizeof eng.b);
    EXPECT_STATUS(strata_engine_default_params(&eng.p, old_engine), STRATA_OK);
    EXPECT(eng.p.struct_size == old_engine);
    EXPECT(all_bytes(eng.b + old_engine, sizeof eng.b - old_engine, 0xAB));
    memset(inf.b, 0xAB, sizeof inf.b);
    inf.p.struct_size = old_info;
    EXPECT_STATUS(strata_engine_info(e, &inf.p), STRATA_OK);
    EXPECT(inf.p.vocab_size == vocab);
    EXPECT(all_bytes(inf.b + old_info, sizeof inf.b - old_info, 0xAB));

    /* A struct_size that cannot even hold struct_size is invalid. */
    for (size = 0; size < sizeof(uint32_t); size++) {
        EXPECT_STATUS(strata_sampling_default_params(&smp.p, size), STRATA_ERR_INVALID_ARGUMENT);
        EXPECT_STATUS(strata_session_default_params(&ssp.p, size), STRATA_ERR_INVALID_ARGUMENT);
        EXPECT_STATUS(strata_engine_default_params(&eng.p, size), STRATA_ERR_INVALID_ARGUMENT);
    }
    REQUIRE_OK(strata_sampling_default_params(&full, sizeof full));
    s = open_prefilled(e);
    full.struct_size = 0;
    EXPECT_STATUS(strata_session_step(s, &full, &got[0]), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(position(s) == args.n_tokens);
    strata_session_free(s);

    /* An older caller's sampling struct, allocated with its exact size so
     * that valgrind sees any read past it: min_p and seed take the defaults. */
    REQUIRE_OK(strata_sampling_default_params(&full, sizeof full));
    full.temperature = 0.8f;
    full.top_k = 40;
    full.top_p = 0.95f;
    s = open_prefilled(e);
    for (i = 0; i < 8; i++)
        REQUIRE_OK(strata_session_step(s, &full, &want[i]));
    strata_session_free(s);
    older = malloc(sizeof *older);
    if (older == NULL)
        exit(1);
    older->struct_size = sizeof *older;
    older->temperature = full.temperature;
    older->top_k = full.top_k;
    older->top_p = full.top_p;
    s = open_prefilled(e);
    for (i = 0; i < 8; i++)
        EXPECT_STATUS(strata_session_step(s, (const strata_sampling_params *)older, &got[i]), STRATA_OK);
    EXPECT(memcmp(want, got, sizeof want) == 0);
    strata_session_free(s);
    free(older);

    /* An older caller's session params: context_size is still read. */
    older_sp = malloc(sizeof *older_sp);
    if (older_sp == NULL)
        exit(1);
    REQUIRE_OK(strata_session_default_params((strata_session_params *)older_sp, sizeof *older_sp));
    EXPECT(older_sp->struct_size == sizeof *older_sp);
    older_sp->context_size = 16;
    REQUIRE_OK(strata_session_open(e, (const strata_session_params *)older_sp, &s));
    for (i = 0; i < 17; i++)
        overflow[i] = (int32_t)(i % vocab);
    EXPECT_STATUS(strata_session_prefill(s, overflow, 17), STRATA_ERR_CONTEXT_OVERFLOW);
    EXPECT(position(s) == 0);
    EXPECT_STATUS(strata_session_prefill(s, overflow, 16), STRATA_OK);
    EXPECT_STATUS(strata_session_step(s, NULL, &got[0]), STRATA_ERR_CONTEXT_OVERFLOW);
    EXPECT(position(s) == 16);
    strata_session_free(s);
    free(older_sp);

    /* An older caller's engine params (struct_size and devices only). */
    older_ep = malloc(sizeof *older_ep);
    if (older_ep == NULL)
        exit(1);
    REQUIRE_OK(strata_engine_default_params((strata_engine_params *)older_ep, sizeof *older_ep));
    EXPECT(older_ep->devices == NULL);
    EXPECT_STATUS(strata_engine_load(args.pack, (const strata_engine_params *)older_ep, &e2), STRATA_OK);
    if (e2 != NULL) {
        s = open_prefilled(e2);
        greedy_tokens(s, got, 8);
        strata_session_free(s);
        s = open_prefilled(e);
        greedy_tokens(s, want, 8);
        strata_session_free(s);
        EXPECT(memcmp(want, got, sizeof want) == 0);
    }
    strata_engine_free(e2);
    free(older_ep);
}

/* ---- bad values ---- */

static void test_invalid_arguments(strata_engine *e)
{
    strata_engine *e2 = NULL;
    strata_engine_params ep;
    strata_session_params sp;
    strata_sampling_params smp;
    strata_session *s = NULL;
    static const char *const cuda[] = {"cuda:0", NULL};
    static const char *const nonsense[] = {"tpu:7", NULL};
    float nan_value;
    int32_t tok;

    /* Paths: invalid UTF-8 is rejected before touching the file system. */
    EXPECT_STATUS(strata_engine_load("\xff\xfe/not-utf8", NULL, &e2), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(e2 == NULL);
    EXPECT_STATUS(strata_engine_load("/nonexistent/strata/pack", NULL, &e2), STRATA_ERR_IO);
    EXPECT(e2 == NULL);

    /* Devices. */
    REQUIRE_OK(strata_engine_default_params(&ep, sizeof ep));
    ep.devices = nonsense;
    EXPECT_STATUS(strata_engine_load(args.pack, &ep, &e2), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(e2 == NULL);
    ep.devices = cuda; /* this build has no CUDA backend */
    EXPECT_STATUS(strata_engine_load(args.pack, &ep, &e2), STRATA_ERR_NO_CUDA);
    EXPECT(e2 == NULL);

    /* Session params: quantized KV is emulated on the CPU backend; an
       out-of-range kv_type is refused; context too big. */
    REQUIRE_OK(strata_session_default_params(&sp, sizeof sp));
    sp.kv_type = STRATA_KV_INT8;
    REQUIRE_OK(strata_session_open(e, &sp, &s));
    strata_session_free(s);
    s = NULL;
    sp.kv_type = (strata_kv_type)9;
    EXPECT_STATUS(strata_session_open(e, &sp, &s), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(s == NULL);
    REQUIRE_OK(strata_session_default_params(&sp, sizeof sp));
    sp.context_size = 0xFFFFFFFFu;
    EXPECT_STATUS(strata_session_open(e, &sp, &s), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(s == NULL);

    /* Sampling params out of range; the session does not move. */
    s = open_prefilled(e);
    nan_value = 0.0f;
    nan_value = nan_value / nan_value;
    REQUIRE_OK(strata_sampling_default_params(&smp, sizeof smp));
    smp.temperature = nan_value;
    EXPECT_STATUS(strata_session_step(s, &smp, &tok), STRATA_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(strata_sampling_default_params(&smp, sizeof smp));
    smp.temperature = 1.0f;
    smp.top_p = 0.0f;
    EXPECT_STATUS(strata_session_step(s, &smp, &tok), STRATA_ERR_INVALID_ARGUMENT);
    REQUIRE_OK(strata_sampling_default_params(&smp, sizeof smp));
    smp.top_k = -1;
    EXPECT_STATUS(strata_session_step(s, &smp, &tok), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(position(s) == args.n_tokens);

    /* An empty prompt. */
    EXPECT_STATUS(strata_session_prefill(s, args.tokens, 0), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(position(s) == args.n_tokens);
    strata_session_free(s);

    /* Step before any prefill: there are no logits to sample from. */
    REQUIRE_OK(strata_session_open(e, NULL, &s));
    EXPECT(strata_session_step(s, NULL, &tok) != STRATA_OK);
    EXPECT(position(s) == 0);
    strata_session_free(s);
}

/* ---- token ids out of range leave the session as it was ---- */

static void test_token_range(strata_engine *e)
{
    strata_session *s = NULL;
    int32_t bad[3], before[4], after[4];
    size_t pos;
    float *l1 = malloc(vocab * sizeof(float)), *l2 = malloc(vocab * sizeof(float));
    size_t n1 = 0, n2 = 0;

    if (l1 == NULL || l2 == NULL)
        exit(1);
    REQUIRE_OK(strata_session_open(e, NULL, &s));
    bad[0] = (int32_t)vocab;
    EXPECT_STATUS(strata_session_prefill(s, bad, 1), STRATA_ERR_TOKEN_OUT_OF_RANGE);
    bad[0] = -1;
    EXPECT_STATUS(strata_session_prefill(s, bad, 1), STRATA_ERR_TOKEN_OUT_OF_RANGE);
    EXPECT(position(s) == 0);

    REQUIRE_OK(strata_session_prefill(s, args.tokens, args.n_tokens));
    pos = position(s);
    REQUIRE_OK(strata_session_logits(s, -1, l1, vocab, &n1));
    bad[0] = 1;
    bad[1] = 2;
    bad[2] = (int32_t)vocab + 1000; /* the last one is bad: nothing of the call is kept */
    EXPECT_STATUS(strata_session_prefill(s, bad, 3), STRATA_ERR_TOKEN_OUT_OF_RANGE);
    EXPECT(position(s) == pos);
    REQUIRE_OK(strata_session_logits(s, -1, l2, vocab, &n2));
    EXPECT(n1 == vocab && n2 == vocab && memcmp(l1, l2, vocab * sizeof(float)) == 0);

    /* ...and the session continues exactly like an untouched one. */
    greedy_tokens(s, after, 4);
    strata_session_free(s);
    s = open_prefilled(e);
    greedy_tokens(s, before, 4);
    EXPECT(memcmp(before, after, sizeof before) == 0);
    strata_session_free(s);
    free(l1);
    free(l2);
}

/* ---- logits and BUFFER_TOO_SMALL ---- */

static void test_logits_and_buffers(strata_engine *e)
{
    strata_session *s = NULL, *other = NULL;
    strata_session_params sp;
    float small[4];
    float *last = malloc(vocab * sizeof(float)), *row = malloc(vocab * sizeof(float));
    size_t n = 0, state_size = 0, i, best = 0;
    uint8_t *state;
    int32_t tok = -1;

    if (last == NULL || row == NULL)
        exit(1);
    s = open_prefilled(e);
    EXPECT_STATUS(strata_session_logits(s, -1, small, 4, &n), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(n == vocab);
    n = 0; /* a size query: NULL with capacity 0 */
    EXPECT_STATUS(strata_session_logits(s, -1, NULL, 0, &n), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(n == vocab);
    n = 0;
    EXPECT_STATUS(strata_session_logits(s, -1, last, vocab, &n), STRATA_OK);
    EXPECT(n == vocab);
    /* Greedy picks the argmax (the lowest index on ties). */
    for (i = 1; i < vocab; i++)
        if (last[i] > last[best])
            best = i;
    REQUIRE_OK(strata_session_step(s, NULL, &tok));
    EXPECT(tok == (int32_t)best);

    /* State: a buffer too small reports the size, nothing is written. */
    REQUIRE_OK(strata_session_state_size(s, &state_size));
    EXPECT(state_size > 0);
    state = malloc(state_size);
    if (state == NULL)
        exit(1);
    memset(state, 0xCD, state_size);
    n = 0;
    EXPECT_STATUS(strata_session_state_save(s, state, state_size - 1, &n), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(n == state_size);
    EXPECT(all_bytes(state, state_size, 0xCD));
    n = 0;
    EXPECT_STATUS(strata_session_state_save(s, NULL, 0, &n), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(n == state_size);
    EXPECT_STATUS(strata_session_state_save(s, state, state_size, &n), STRATA_OK);
    EXPECT(n == state_size);
    /* Truncated or damaged state is rejected and leaves the target as it was. */
    REQUIRE_OK(strata_session_open(e, NULL, &other));
    EXPECT(strata_session_state_load(other, state, state_size - 1) != STRATA_OK);
    EXPECT(position(other) == 0);
    state[0] ^= 0xFF;
    EXPECT(strata_session_state_load(other, state, state_size) != STRATA_OK);
    EXPECT(position(other) == 0);
    state[0] ^= 0xFF;
    EXPECT_STATUS(strata_session_state_load(other, state, state_size), STRATA_OK);
    EXPECT(position(other) == args.n_tokens + 1);
    n = 0;
    EXPECT_STATUS(strata_session_logits(other, -1, row, vocab, &n), STRATA_OK);
    REQUIRE_OK(strata_session_logits(s, -1, last, vocab, &n));
    EXPECT(memcmp(row, last, vocab * sizeof(float)) == 0);
    strata_session_free(other);
    strata_session_free(s);
    free(state);

    /* keep_all_logits: every position of the last prefill, by absolute or
     * negative index; without it only the last one. */
    REQUIRE_OK(strata_session_default_params(&sp, sizeof sp));
    sp.keep_all_logits = true;
    REQUIRE_OK(strata_session_open(e, &sp, &s));
    REQUIRE_OK(strata_session_prefill(s, args.tokens, args.n_tokens));
    REQUIRE_OK(strata_session_logits(s, -1, last, vocab, &n));
    EXPECT_STATUS(strata_session_logits(s, (int64_t)args.n_tokens - 1, row, vocab, &n), STRATA_OK);
    EXPECT(memcmp(row, last, vocab * sizeof(float)) == 0);
    if (args.n_tokens >= 2) {
        REQUIRE_OK(strata_session_logits(s, -2, last, vocab, &n));
        EXPECT_STATUS(strata_session_logits(s, (int64_t)args.n_tokens - 2, row, vocab, &n), STRATA_OK);
        EXPECT(memcmp(row, last, vocab * sizeof(float)) == 0);
    }
    /* Past either end, or not kept: INVALID_ARGUMENT. */
    EXPECT_STATUS(strata_session_logits(s, (int64_t)args.n_tokens, row, vocab, &n), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(strata_session_logits(s, -(int64_t)args.n_tokens - 1, row, vocab, &n),
                  STRATA_ERR_INVALID_ARGUMENT);
    strata_session_free(s);
    if (args.n_tokens >= 2) {
        s = open_prefilled(e);
        EXPECT_STATUS(strata_session_logits(s, -2, row, vocab, &n), STRATA_ERR_INVALID_ARGUMENT);
        strata_session_free(s);
    }
    free(last);
    free(row);
}

/* ---- checkpoints ---- */

static void test_checkpoints(strata_engine *e)
{
    strata_session *s = open_prefilled(e);
    uint64_t c1 = 0, c2 = 0;
    int32_t a[6], b[6];
    size_t p0 = position(s);

    EXPECT_STATUS(strata_session_rewind(s, 0xDEADBEEFull), STRATA_ERR_NOT_FOUND);
    REQUIRE_OK(strata_session_checkpoint(s, &c1));
    greedy_tokens(s, a, 3);
    REQUIRE_OK(strata_session_checkpoint(s, &c2));
    EXPECT(c1 != c2);
    greedy_tokens(s, a + 3, 3);
    EXPECT_STATUS(strata_session_rewind(s, c1), STRATA_OK);
    EXPECT(position(s) == p0);
    /* c2 lies past the rewound position: it is gone. */
    EXPECT_STATUS(strata_session_rewind(s, c2), STRATA_ERR_NOT_FOUND);
    EXPECT(position(s) == p0);
    greedy_tokens(s, b, 6);
    EXPECT(memcmp(a, b, sizeof a) == 0);
    /* c1 can be used again, until it is released. */
    EXPECT_STATUS(strata_session_rewind(s, c1), STRATA_OK);
    EXPECT(position(s) == p0);
    REQUIRE_OK(strata_session_checkpoint(s, &c2));
    EXPECT_STATUS(strata_session_checkpoint_release(s, c2), STRATA_OK);
    EXPECT_STATUS(strata_session_checkpoint_release(s, c2), STRATA_ERR_NOT_FOUND);
    EXPECT_STATUS(strata_session_rewind(s, c2), STRATA_ERR_NOT_FOUND);

    /* rewind_to: keep the first n tokens; past the end is rejected. */
    EXPECT_STATUS(strata_session_rewind_to(s, p0 + 1), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(position(s) == p0);
    if (p0 >= 2) {
        EXPECT_STATUS(strata_session_rewind_to(s, p0 - 1), STRATA_OK);
        EXPECT(position(s) == p0 - 1);
        REQUIRE_OK(strata_session_prefill(s, &args.tokens[p0 - 1], 1));
        greedy_tokens(s, b, 6);
        EXPECT(memcmp(a, b, sizeof a) == 0);
    }
    strata_session_free(s);
}

/* ---- lifetimes and frees ---- */

static void test_lifetimes(void)
{
    strata_engine *e = NULL;
    strata_session *s = NULL;
    int32_t a[4], b[4];

    strata_engine_free(NULL);
    strata_session_free(NULL);

    /* The session keeps the model alive after the engine is freed. */
    REQUIRE_OK(strata_engine_load(args.pack, NULL, &e));
    s = open_prefilled(e);
    greedy_tokens(s, a, 2);
    strata_engine_free(e);
    greedy_tokens(s, a + 2, 2);
    strata_session_free(s);
    REQUIRE_OK(strata_engine_load(args.pack, NULL, &e));
    s = open_prefilled(e);
    greedy_tokens(s, b, 4);
    strata_session_free(s);
    strata_engine_free(e);
    EXPECT(memcmp(a, b, sizeof a) == 0);
}

static void test_load_free_cycles(void)
{
    const char *env = getenv("STRATA_TEST_CYCLES");
    int cycles = env != NULL ? atoi(env) : 20, i;
    for (i = 0; i < cycles; i++) {
        strata_engine *e = NULL;
        strata_session *s = NULL;
        size_t size = 0, n = 0;
        uint8_t *state;
        int32_t t[2];
        REQUIRE_OK(strata_engine_load(args.pack, NULL, &e));
        s = open_prefilled(e);
        greedy_tokens(s, t, 2);
        REQUIRE_OK(strata_session_state_size(s, &size));
        state = malloc(size);
        if (state == NULL)
            exit(1);
        REQUIRE_OK(strata_session_state_save(s, state, size, &n));
        free(state);
        /* A failure sets the thread's message: that must not leak either. */
        EXPECT(strata_session_prefill(s, t, 0) != STRATA_OK);
        strata_session_free(s);
        strata_engine_free(e);
    }
}

/* ---- callbacks ---- */

static int progress_calls;
static bool cancel_load(void *user_data, float fraction)
{
    (void)user_data;
    EXPECT(fraction >= 0.0f && fraction <= 1.0f);
    progress_calls++;
    return false;
}

static int log_calls;
static void count_log(void *user_data, strata_log_level level, const char *message)
{
    (void)level;
    (void)message;
    (*(int *)user_data)++;
}

static void test_callbacks(void)
{
    strata_engine_params ep;
    strata_engine *e = NULL;
    strata_status st;

    REQUIRE_OK(strata_engine_default_params(&ep, sizeof ep));
    ep.progress = cancel_load;
    st = strata_engine_load(args.pack, &ep, &e);
    if (progress_calls > 0) {
        EXPECT(st == STRATA_ERR_CANCELLED);
        EXPECT(e == NULL);
    } else {
        EXPECT(st == STRATA_OK);
    }
    strata_engine_free(e);

    EXPECT_STATUS(strata_set_log_callback(count_log, &log_calls, STRATA_LOG_DEBUG), STRATA_OK);
    REQUIRE_OK(strata_engine_load(args.pack, NULL, &e));
    strata_engine_free(e);
    EXPECT_STATUS(strata_set_log_callback(NULL, NULL, STRATA_LOG_ERROR), STRATA_OK);
}

/* ---- threads: last_error is per thread; a session is one thread's at a time ---- */

static void *fail_on_other_thread(void *arg)
{
    strata_engine *e = NULL;
    (void)arg;
    EXPECT(strata_engine_load("/nonexistent/other-thread", NULL, &e) == STRATA_ERR_IO);
    EXPECT(strstr(strata_last_error(), "other-thread") != NULL);
    return NULL;
}

struct busy_job {
    strata_session *s;
    int32_t *prompt;
    size_t n;
    strata_status st;
    pthread_mutex_t mu;
    int done;
};

static void *long_prefill(void *arg)
{
    struct busy_job *job = arg;
    job->st = strata_session_prefill(job->s, job->prompt, job->n);
    pthread_mutex_lock(&job->mu);
    job->done = 1;
    pthread_mutex_unlock(&job->mu);
    return NULL;
}

static int job_done(struct busy_job *job)
{
    int d;
    pthread_mutex_lock(&job->mu);
    d = job->done;
    pthread_mutex_unlock(&job->mu);
    return d;
}

static void test_threads(strata_engine *e)
{
    pthread_t t;
    strata_engine *none = NULL;
    char mine[256];
    struct busy_job job;
    size_t i, pos = 0;
    long busy = 0, ok = 0, other = 0;

    EXPECT(strata_engine_load("/nonexistent/main-thread", NULL, &none) == STRATA_ERR_IO);
    snprintf(mine, sizeof mine, "%s", strata_last_error());
    EXPECT(strstr(mine, "main-thread") != NULL);
    if (pthread_create(&t, NULL, fail_on_other_thread, NULL) != 0)
        exit(1);
    pthread_join(t, NULL);
    EXPECT(strcmp(strata_last_error(), mine) == 0);

    /* While one thread prefills, calls on the same session from another
     * either succeed or report BUSY; the session is never corrupted. */
    job.n = 1024;
    job.done = 0;
    pthread_mutex_init(&job.mu, NULL);
    job.prompt = malloc(job.n * sizeof(int32_t));
    if (job.prompt == NULL)
        exit(1);
    for (i = 0; i < job.n; i++)
        job.prompt[i] = (int32_t)((i * 7 + 3) % vocab);
    REQUIRE_OK(strata_session_open(e, NULL, &job.s));
    if (pthread_create(&t, NULL, long_prefill, &job) != 0)
        exit(1);
    while (!job_done(&job)) {
        strata_status st = strata_session_position(job.s, &pos);
        if (st == STRATA_OK)
            ok++;
        else if (st == STRATA_ERR_BUSY)
            busy++;
        else
            other++;
    }
    pthread_join(t, NULL);
    EXPECT(job.st == STRATA_OK || job.st == STRATA_ERR_BUSY);
    EXPECT(other == 0);
    EXPECT(position(job.s) == (job.st == STRATA_OK ? job.n : 0));
    fprintf(stderr, "test: concurrent position calls during a prefill: %ld ok, %ld busy\n", ok, busy);
    strata_session_free(job.s);
    pthread_mutex_destroy(&job.mu);
    free(job.prompt);
}

/* ---- tokenizer ---- */

static void test_tokenizer(strata_engine *e, const strata_model_info *info)
{
    const char *path = getenv("STRATA_TOKENIZER_PACK");
    const char *text = "The river carried";
    strata_engine *te = NULL;
    strata_model_info tinfo;
    strata_session *s = NULL, *ts = NULL;
    int32_t toks[64], one = 0;
    size_t n = 0, need = 0, state_size = 0;
    char buf[256], tiny[2];
    uint8_t *state;

    if (!info->has_tokenizer)
        EXPECT_STATUS(strata_tokenize(e, text, strlen(text), toks, 64, &n), STRATA_ERR_TOKENIZER);
    if (path == NULL || path[0] == '\0') {
        fprintf(stderr, "test: STRATA_TOKENIZER_PACK not set, tokenizer checks skipped\n");
        return;
    }
    REQUIRE_OK(strata_engine_load(path, NULL, &te));
    tinfo.struct_size = sizeof tinfo;
    REQUIRE_OK(strata_engine_info(te, &tinfo));
    EXPECT(tinfo.has_tokenizer);

    EXPECT_STATUS(strata_tokenize(te, text, strlen(text), toks, 1, &need), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(need > 1);
    n = 0;
    EXPECT_STATUS(strata_tokenize(te, text, strlen(text), NULL, 0, &n), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(n == need);
    EXPECT_STATUS(strata_tokenize(te, text, strlen(text), toks, 64, &n), STRATA_OK);
    EXPECT(n == need);
    EXPECT_STATUS(strata_tokenize(te, "\xff\xfe", 2, toks, 64, &n), STRATA_ERR_INVALID_ARGUMENT);
    /* text_len counts bytes; the text needs no NUL. */
    EXPECT_STATUS(strata_tokenize(te, "The river carried!!!", strlen(text), toks, 64, &n), STRATA_OK);
    EXPECT(n == need);

    /* Too small: *n_out is the size needed, NUL included; on success the length without it. */
    EXPECT_STATUS(strata_detokenize(te, toks, n, tiny, sizeof tiny, &need), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(need == strlen(text) + 1);
    need = 0;
    EXPECT_STATUS(strata_detokenize(te, toks, n, NULL, 0, &need), STRATA_ERR_BUFFER_TOO_SMALL);
    EXPECT(need == strlen(text) + 1);
    EXPECT_STATUS(strata_detokenize(te, toks, n, buf, sizeof buf, &need), STRATA_OK);
    EXPECT(need == strlen(text) && strcmp(buf, text) == 0);
    one = (int32_t)tinfo.vocab_size;
    EXPECT_STATUS(strata_detokenize(te, &one, 1, buf, sizeof buf, &need), STRATA_ERR_TOKEN_OUT_OF_RANGE);

    /* State is tied to its model: loading it into another model's session fails. */
    s = open_prefilled(e);
    REQUIRE_OK(strata_session_state_size(s, &state_size));
    state = malloc(state_size);
    if (state == NULL)
        exit(1);
    REQUIRE_OK(strata_session_state_save(s, state, state_size, &n));
    REQUIRE_OK(strata_session_open(te, NULL, &ts));
    EXPECT_STATUS(strata_session_state_load(ts, state, n), STRATA_ERR_INVALID_ARGUMENT);
    EXPECT(position(ts) == 0);
    strata_session_free(ts);
    strata_session_free(s);
    strata_engine_free(te);
    free(state);
}

int main(int argc, char **argv)
{
    strata_engine *e = NULL;
    strata_session *s = NULL;
    strata_sampling_params sampling;
    strata_model_info info;
    int32_t *out;
    unsigned i;

    if (!cli_parse(argc, argv, 1, &args))
        return 2;
    if (args.n_tokens == 0) {
        fprintf(stderr, "test: TOKENS must be a list of token ids\n");
        return 2;
    }
    test_versions();
    REQUIRE_OK(strata_engine_load(args.pack, NULL, &e));
    info.struct_size = sizeof info;
    REQUIRE_OK(strata_engine_info(e, &info));
    vocab = info.vocab_size;

    test_null_pointers(e);
    test_struct_size(e);
    test_invalid_arguments(e);
    test_token_range(e);
    test_logits_and_buffers(e);
    test_checkpoints(e);
    test_lifetimes();
    test_load_free_cycles();
    test_callbacks();
    test_threads(e);
    test_tokenizer(e, &info);

    /* The tokens, for comparison with `strata generate`. */
    REQUIRE_OK(strata_sampling_default_params(&sampling, sizeof sampling));
    sampling.temperature = args.temperature;
    sampling.top_k = args.top_k;
    sampling.top_p = args.top_p;
    sampling.min_p = args.min_p;
    sampling.seed = args.seed;
    out = malloc((args.n > 0 ? args.n : 1) * sizeof *out);
    if (out == NULL)
        return 1;
    s = open_prefilled(e);
    for (i = 0; i < args.n; i++)
        REQUIRE_OK(strata_session_step(s, &sampling, &out[i]));
    cli_print_tokens(out, args.n);
    strata_session_free(s);
    strata_engine_free(e);
    free(out);

    fprintf(stderr, "test: %d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
