// ggml's product y (M, N) = x (M, K) @ w^T with w in the CPU backend's repacking buffer type
// (ggml-cpu/repack.cpp: Q4_K into block_q4_Kx8 rows, multiplied by its gemv / gemm kernels), as
// llama.cpp loads a model's weights: what benchmarks/kernels/block_types.py sets beside qkv's
// repacked Q4_K. Falls back to the plain CPU buffer (and says so on stderr) where ggml has no
// repacking buffer type.
//
//   ggml_repacked_mul_mat TYPE N K M THREADS CALLS  ->  prints the median microseconds of CALLS products
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static struct ggml_context *metadata_context(void) {
    struct ggml_init_params params = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    return ggml_init(params);
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s TYPE N K M THREADS CALLS\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = (enum ggml_type)atoi(argv[1]);
    const int n = atoi(argv[2]), k = atoi(argv[3]), m = atoi(argv[4]), threads = atoi(argv[5]), calls = atoi(argv[6]);
    ggml_backend_dev_t device = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t backend = ggml_backend_dev_init(device, NULL);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(device);
    ggml_backend_set_n_threads_t set_threads = (ggml_backend_set_n_threads_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set_threads) set_threads(backend, threads);
    ggml_backend_buffer_type_t weights_type = ggml_backend_cpu_buffer_type();
    ggml_backend_dev_get_extra_bufts_t extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    int repacked = 0;
    for (ggml_backend_buffer_type_t *b = extra ? extra(device) : NULL; b && *b; b++)
        if (strstr(ggml_backend_buft_name(*b), "REPACK")) weights_type = *b, repacked = 1;
    if (!repacked) fprintf(stderr, "no repacking buffer type in this ggml: its plain buffer\n");

    struct ggml_context *wctx = metadata_context(), *xctx = metadata_context(), *gctx = metadata_context();
    struct ggml_tensor *w = ggml_new_tensor_2d(wctx, type, k, n);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, weights_type);
    float *values = malloc(sizeof(float) * (size_t)k * n);
    srand(0);
    for (size_t i = 0; i < (size_t)k * n; i++) values[i] = (float)rand() / RAND_MAX - 0.5f;
    void *quantized = malloc(ggml_row_size(type, k) * n);
    ggml_quantize_chunk(type, values, quantized, 0, n, k, NULL);
    ggml_backend_tensor_set(w, quantized, 0, ggml_row_size(type, k) * n);  // the repacking happens here
    free(quantized);
    struct ggml_tensor *x = ggml_new_tensor_2d(xctx, GGML_TYPE_F32, k, m);
    struct ggml_tensor *y = ggml_mul_mat(xctx, w, x);
    ggml_backend_buffer_t xbuf = ggml_backend_alloc_ctx_tensors_from_buft(xctx, ggml_backend_cpu_buffer_type());
    for (size_t i = 0; i < (size_t)k * m; i++) values[i] = (float)rand() / RAND_MAX - 0.5f;
    ggml_backend_tensor_set(x, values, 0, sizeof(float) * (size_t)k * m);
    free(values);
    struct ggml_cgraph *graph = ggml_new_graph(gctx);
    ggml_build_forward_expand(graph, y);
    double *samples = malloc(sizeof(double) * calls);
    for (int i = 0; i < calls + 20; i++) {
        const double start = now_us();
        ggml_backend_graph_compute(backend, graph);
        if (i >= 20) samples[i - 20] = now_us() - start;
    }
    qsort(samples, calls, sizeof(double), by_value);
    printf("%s %d %d %d %d %s %.2f\n", ggml_type_name(type), n, k, m, threads, repacked ? "repacked" : "plain", samples[calls / 2]);
    ggml_backend_buffer_free(xbuf);
    ggml_backend_buffer_free(wbuf);
    ggml_backend_free(backend);
    return 0;
}
