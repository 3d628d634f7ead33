/* A stand-in for libcuda.so.1 exporting the driver entry points kvtier calls through ctypes
 * (kvtier/cuda.py, kvtier/worker/engines/memcpy_batch.py), written from their CUDA 12.8
 * prototypes in cuda.h. It is not a driver: the "batched copy" is a memcpy of host bytes, done
 * at once. What it proves, on a machine without a GPU, is the calling side: argument order and
 * types, the CUmemcpyAttributes layout, the version asked of cuGetProcAddress, how a refused
 * copy's index comes back. Each call's arguments are checked and remembered for the test.
 *
 * Streams are heap cells: cuStreamCreateWithPriority records its flags and priority and
 * counts the streams made.
 *
 * Environment: STANDIN_CUDA_VERSION (default 13000) is what cuDriverGetVersion reports;
 * STANDIN_UNMAPPED=1 makes cuMemHostGetDevicePointer fail as for unregistered memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_FOUND 500

typedef struct { int type; int id; } CUmemLocation;              /* CUmemLocationType, int */
typedef struct {
    int srcAccessOrder;                                             /* CUmemcpySrcAccessOrder */
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

#define HOST_TO_DEVICE_OFFSET 0x100000u /* where this stand-in "maps" host memory */

static int last_order = -1;
static uint64_t last_stream = 0;
static size_t last_count = 0;

int standin_last_order(void) { return last_order; }
uint64_t standin_last_stream(void) { return last_stream; }
size_t standin_last_count(void) { return last_count; }

CUresult cuDriverGetVersion(int *version) {
    const char *forced = getenv("STANDIN_CUDA_VERSION");
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = forced ? atoi(forced) : 13000;
    return CUDA_SUCCESS;
}

/* PFN_cuMemcpyBatchAsync_v12080: the form with failIdx */
static CUresult memcpy_batch(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
                             CUmemcpyAttributes *attrs, size_t *attrs_idxs, size_t num_attrs,
                             size_t *fail_idx, void *stream) {
    if (count == 0 || dsts == NULL || srcs == NULL || sizes == NULL || fail_idx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (num_attrs != 1 || attrs == NULL || attrs_idxs == NULL || attrs_idxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((attrs->srcAccessOrder != 1 && attrs->srcAccessOrder != 3) || attrs->flags != 0 ||
        attrs->srcLocHint.type != 0 || attrs->dstLocHint.type != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (dsts[i] == 0 || srcs[i] == 0 || sizes[i] == 0) {
            *fail_idx = i;
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (size_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
    last_order = attrs->srcAccessOrder;
    last_stream = (uint64_t)(uintptr_t)stream;
    last_count = count;
    return CUDA_SUCCESS;
}

/* cuGetProcAddress_v2 (CUDA 12.0+): symbol, &pfn, cudaVersion, flags, symbolStatus */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, uint64_t flags,
                             int *symbol_status) {
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(symbol, "cuMemcpyBatchAsync") == 0 && cuda_version == 12080 && flags == 0) {
        *pfn = (void *)memcpy_batch;
        if (symbol_status) *symbol_status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
        return CUDA_SUCCESS;
    }
    if (symbol_status) *symbol_status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuMemHostGetDevicePointer_v2(uint64_t *device_ptr, void *host_ptr, unsigned int flags) {
    if (device_ptr == NULL || host_ptr == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (getenv("STANDIN_UNMAPPED")) return CUDA_ERROR_INVALID_VALUE;
    *device_ptr = (uint64_t)(uintptr_t)host_ptr + HOST_TO_DEVICE_OFFSET;
    return CUDA_SUCCESS;
}

/* streams: a handle is a heap cell holding the priority it was made with (never freed) */
static unsigned int last_stream_flags = 0;
static int last_stream_priority = 0;
static int live_streams = 0;

unsigned int standin_last_stream_flags(void) { return last_stream_flags; }
int standin_last_stream_priority(void) { return last_stream_priority; }
int standin_live_streams(void) { return live_streams; }

CUresult cuStreamCreateWithPriority(void **stream, unsigned int flags, int priority) {
    if (stream == NULL || (flags & ~1u) != 0) return CUDA_ERROR_INVALID_VALUE;
    int *cell = malloc(sizeof(int));
    if (cell == NULL) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *cell = priority;
    *stream = cell;
    last_stream_flags = flags;
    last_stream_priority = priority;
    live_streams++;
    return CUDA_SUCCESS;
}
