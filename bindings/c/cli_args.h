/* Command-line arguments shared by the C examples (example.c, test.c,
 * plugin_host.c). Header-only so that each example is still one file to read.
 *
 *   PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
 *
 * TOKENS is a comma-separated list of token ids ("1,2,3,4,5"). The sampling
 * defaults are those of `strata generate`: greedy (temperature 0), top_k 0,
 * top_p 1, min_p 0.
 */
#ifndef STRATA_EXAMPLE_CLI_ARGS_H
#define STRATA_EXAMPLE_CLI_ARGS_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CLI_MAX_TOKENS 4096

struct cli_args {
    const char *pack;
    const char *prompt;          /* the TOKENS argument as given */
    int32_t tokens[CLI_MAX_TOKENS];
    size_t n_tokens;             /* 0 when TOKENS is not a list of integers */
    unsigned n;                  /* tokens to generate */
    uint64_t seed;
    float temperature;
    int32_t top_k;
    float top_p;
    float min_p;
};

/* Parses "1,2,3" into out; returns the count, or 0 if s is not such a list. */
static size_t cli_parse_tokens(const char *s, int32_t *out, size_t cap)
{
    size_t n = 0;
    const char *p = s;
    while (*p != '\0') {
        char *end;
        long v;
        errno = 0;
        v = strtol(p, &end, 10);
        if (end == p || errno != 0 || v < INT32_MIN || v > INT32_MAX || n == cap)
            return 0;
        out[n++] = (int32_t)v;
        if (*end == ',')
            end++;
        else if (*end != '\0')
            return 0;
        p = end;
    }
    return n;
}

static int cli_parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    *out = strtof(s, &end);
    return end != s && *end == '\0' && errno == 0;
}

/* argv[first] is PACK. Returns 0 and prints usage on error. */
static int cli_parse(int argc, char **argv, int first, struct cli_args *a)
{
    char *end;
    unsigned long long v;
    long k;
    int nargs = argc - first;

    memset(a, 0, sizeof *a);
    a->top_p = 1.0f;
    if (nargs < 4 || nargs > 8)
        goto usage;
    a->pack = argv[first];
    a->prompt = argv[first + 1];
    a->n_tokens = cli_parse_tokens(a->prompt, a->tokens, CLI_MAX_TOKENS);

    errno = 0;
    v = strtoull(argv[first + 2], &end, 10);
    if (*end != '\0' || end == argv[first + 2] || errno != 0 || v > 1000000)
        goto usage;
    a->n = (unsigned)v;
    errno = 0;
    a->seed = strtoull(argv[first + 3], &end, 10);
    if (*end != '\0' || end == argv[first + 3] || errno != 0)
        goto usage;
    if (nargs > 4 && !cli_parse_float(argv[first + 4], &a->temperature))
        goto usage;
    if (nargs > 5) {
        errno = 0;
        k = strtol(argv[first + 5], &end, 10);
        if (*end != '\0' || end == argv[first + 5] || errno != 0 || k < 0 || k > INT32_MAX)
            goto usage;
        a->top_k = (int32_t)k;
    }
    if (nargs > 6 && !cli_parse_float(argv[first + 6], &a->top_p))
        goto usage;
    if (nargs > 7 && !cli_parse_float(argv[first + 7], &a->min_p))
        goto usage;
    return 1;

usage:
    fprintf(stderr,
            "usage: %s %sPACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]\n"
            "  TOKENS: comma-separated token ids, e.g. 1,2,3,4,5\n",
            argv[0], first > 1 ? "LIBRARY " : "");
    return 0;
}

/* Prints tokens on one line, space-separated, to stdout. */
static void cli_print_tokens(const int32_t *tokens, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        printf(i == 0 ? "%d" : " %d", (int)tokens[i]);
    printf("\n");
    fflush(stdout);
}

#endif
