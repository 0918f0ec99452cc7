// ktrace: every kernel's start and end on the device, from CUPTI's
// concurrent-kernel activity records, written as CSV for scripts/ktrace.py.
// A CUDA injection library: the driver loads it into any CUDA program
// (strata included) named by CUDA_INJECTION64_PATH, so no engine code
// changes. The times are the hardware's (first block start, last block
// end), and programmatic-launch overlap shows as a kernel starting before
// its predecessor ends. Tracing adds host time between steps (CUPTI's
// buffers), not kernel time: compare the step span it prints with the
// bench's step, not its tok/s.
//
// Build (here, without a GPU: CUPTI 13.0's headers and library from PyPI):
//   pip download --no-deps "nvidia-cuda-cupti==13.0.*" -d /tmp/cupti
//   (cd /tmp/cupti && unzip -q -o *.whl)
//   gcc -O2 -shared -fPIC -o libktrace.so scripts/ktrace.c \
//     -I/tmp/cupti/nvidia/cu13/include -I.cuda/site/nvidia/cu13/include \
//     -L/tmp/cupti/nvidia/cu13/lib -l:libcupti.so.13
// Run (on the device; the toolkit's libcupti.so.13 at run time):
//   LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib \
//   CUDA_INJECTION64_PATH=$PWD/libktrace.so KTRACE_OUT=k.csv \
//     strata bench --pack /tmp/s30 --prompt-len 4096 --gen 24 --repeats 1
//   python3 scripts/ktrace.py k.csv
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static FILE* out;
static CUpti_SubscriberHandle sub;

static void CUPTIAPI requested(uint8_t** buf, size_t* size, size_t* maxrec) {
    *size = 16 << 20;
    *buf = (uint8_t*)aligned_alloc(8, *size);
    *maxrec = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t* buf, size_t size, size_t valid) {
    CUpti_Activity* r = NULL;
    (void)ctx; (void)stream; (void)size;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            CUpti_ActivityKernel10* k = (CUpti_ActivityKernel10*)r;
            if (out)
                fprintf(out, "%llu,%llu,%u,%llu,%d,%d,%d,%d,%s\n", (unsigned long long)k->start,
                        (unsigned long long)k->end, k->graphId, (unsigned long long)k->graphNodeId, k->gridX,
                        k->gridY, k->gridZ, k->blockX, k->name);
        }
    }
    free(buf);
}

static void flush_all(void) {
    cuptiActivityFlushAll(1);
    if (out) fflush(out);
}

static void CUPTIAPI on_cb(void* ud, CUpti_CallbackDomain dom, CUpti_CallbackId id, const void* data) {
    (void)ud; (void)data;
    if (dom == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) flush_all();
}

int InitializeInjection(void) {
    const char* path = getenv("KTRACE_OUT");
    out = fopen(path ? path : "ktrace.csv", "w");
    if (!out) return 0;
    fprintf(out, "start,end,graph,node,gx,gy,gz,bx,name\n");
    cuptiActivityRegisterCallbacks(requested, completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiSubscribe(&sub, on_cb, NULL);
    cuptiEnableDomain(1, sub, CUPTI_CB_DOMAIN_RESOURCE);
    atexit(flush_all);
    return 1;
}
