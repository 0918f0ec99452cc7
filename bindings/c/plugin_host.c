/* plugin_host.c: use Strata as a plugin. The host does not link against the
 * library: it dlopen()s it by path, resolves the one symbol strata_get_api and
 * makes every call through the returned function table. strata.h is used for
 * the types only.
 *
 *   ./plugin_host LIBRARY PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
 *
 * Prints the N generated tokens on stdout (one line, space-separated).
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "cli_args.h"

typedef strata_status (*get_api_fn)(uint32_t abi_version, const strata_api **out);

/* The ABI this host was written against. */
#define HOST_ABI STRATA_ABI_VERSION

static const strata_api *api;

static int failed(const char *what, strata_status st)
{
    fprintf(stderr, "plugin_host: %s failed: %s (status %d): %s\n", what, api->status_message(st), (int)st,
            api->last_error());
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

int main(int argc, char **argv)
{
    static struct cli_args args;
    void *lib;
    void *sym;
    get_api_fn get_api;
    strata_status st;
    strata_engine *engine = NULL;
    strata_session *session = NULL;
    strata_sampling_params sampling;
    strata_model_info info;
    int32_t *out = NULL, *eos = NULL, again[4], first[4];
    size_t n_eos = 0, n_out = 0, j;
    uint64_t checkpoint = 0;
    unsigned i;
    int ok = 0;

    if (!cli_parse(argc, argv, 2, &args))
        return 2;
    if (args.n_tokens == 0) {
        fprintf(stderr, "plugin_host: TOKENS must be a list of token ids\n");
        return 2;
    }

    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "plugin_host: dlopen: %s\n", dlerror());
        return 1;
    }
    sym = dlsym(lib, "strata_get_api");
    if (sym == NULL) {
        fprintf(stderr, "plugin_host: dlsym(strata_get_api): %s\n", dlerror());
        dlclose(lib);
        return 1;
    }
    /* ISO C has no cast between object and function pointers; POSIX
     * guarantees the representation, so copy the bits. */
    memcpy(&get_api, &sym, sizeof get_api);

    st = get_api(HOST_ABI, &api);
    if (st != STRATA_OK || api == NULL) {
        fprintf(stderr, "plugin_host: strata_get_api(%d) returned status %d\n", HOST_ABI, (int)st);
        dlclose(lib);
        return 1;
    }
    /* A library may be newer (a longer table) but never shorter than what
     * this host calls. */
    if (api->struct_size < offsetof(strata_api, detokenize) + sizeof api->detokenize) {
        fprintf(stderr, "plugin_host: the library's table has %u bytes, this host needs %u\n",
                (unsigned)api->struct_size, (unsigned)(offsetof(strata_api, detokenize) + sizeof api->detokenize));
        dlclose(lib);
        return 1;
    }
    fprintf(stderr, "plugin_host: %s: strata %s, ABI %u, table %u bytes\n", argv[1], api->version(),
            (unsigned)api->abi_version, (unsigned)api->struct_size);

    CHECK(api->engine_load(args.pack, NULL, &engine));
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK(api->engine_info(engine, &info));
    fprintf(stderr, "plugin_host: vocab %u, %u layers, %u experts\n", (unsigned)info.vocab_size,
            (unsigned)info.num_layers, (unsigned)info.num_experts);

    CHECK(api->session_open(engine, NULL, &session));
    CHECK(api->sampling_default_params(&sampling, sizeof sampling));
    sampling.temperature = args.temperature;
    sampling.top_k = args.top_k;
    sampling.top_p = args.top_p;
    sampling.min_p = args.min_p;
    sampling.seed = args.seed;

    /* A function appended to the table later (end-of-generation tokens):
     * used only when the library's table reaches it. */
    if (api->struct_size >= offsetof(strata_api, engine_eos_tokens) + sizeof api->engine_eos_tokens) {
        st = api->engine_eos_tokens(engine, NULL, 0, &n_eos);
        if (st == STRATA_ERR_BUFFER_TOO_SMALL) {
            eos = malloc(n_eos * sizeof *eos);
            if (eos == NULL)
                goto done;
            st = api->engine_eos_tokens(engine, eos, n_eos, &n_eos);
        }
        CHECK(st);
    }

    CHECK(api->session_prefill(session, args.tokens, args.n_tokens));
    out = malloc((args.n > 0 ? args.n : 1) * sizeof *out);
    if (out == NULL)
        goto done;
    /* Up to N steps, ending before an end-of-generation token, as
     * `strata generate` does. */
    for (n_out = 0; n_out < (size_t)args.n; n_out++) {
        CHECK(api->session_step(session, &sampling, &out[n_out]));
        for (j = 0; j < n_eos && out[n_out] != eos[j]; j++)
            ;
        if (j < n_eos)
            break;
    }
    cli_print_tokens(out, n_out);

    /* Checkpoint and rewind through the table too (greedy continuations). */
    CHECK(api->session_checkpoint(session, &checkpoint));
    for (i = 0; i < 4; i++)
        CHECK(api->session_step(session, NULL, &first[i]));
    CHECK(api->session_rewind(session, checkpoint));
    for (i = 0; i < 4; i++)
        CHECK(api->session_step(session, NULL, &again[i]));
    if (memcmp(first, again, sizeof first) != 0) {
        fprintf(stderr, "plugin_host: the continuation after rewind differs\n");
        goto done;
    }
    ok = 1;

done:
    api->session_free(session);
    api->engine_free(engine);
    free(out);
    free(eos);
    /* Everything from the library is freed; unloading it is the host's call.
     * (A library with a global thread pool may stay mapped; that is fine.) */
    dlclose(lib);
    return ok ? 0 : 1;
}
