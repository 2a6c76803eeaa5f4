// ggml's own product y (M, N) = x (M, K) @ w^T for one GGUF block type, timed: what
// benchmarks/kernels/block_types.py sets beside qkv's block products. ggml's CPU backend
// rounds x to the type's vec_dot_type and runs its vec_dot kernels (a plain context: no
// repacked weights; for M > 1 the CPU backend's own multi-row paths, as in a prompt's prefill),
// on a thread pool made once.
//
//   ggml_mul_mat TYPE N K THREADS CALLS [M]  ->  prints the median microseconds of CALLS products (M: 1)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
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

int main(int argc, char **argv) {
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s TYPE N K THREADS CALLS [M]\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = (enum ggml_type)atoi(argv[1]);
    const int n = atoi(argv[2]), k = atoi(argv[3]), threads = atoi(argv[4]), calls = atoi(argv[5]), rows = argc == 7 ? atoi(argv[6]) : 1;
    ggml_cpu_init();
    const size_t weight_bytes = ggml_row_size(type, k) * n;
    struct ggml_init_params params = {weight_bytes + (size_t)k * 4 * 4 * rows + (size_t)n * 4 * 4 * rows + 64 * 1024 * 1024, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, k, n), *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, rows);
    float *values = malloc(sizeof(float) * (size_t)k * n);
    srand(0);
    for (size_t i = 0; i < (size_t)k * n; i++) values[i] = (float)rand() / RAND_MAX - 0.5f;
    ggml_quantize_chunk(type, values, w->data, 0, n, k, NULL);
    for (size_t i = 0; i < (size_t)k * rows; i++) ((float *)x->data)[i] = (float)rand() / RAND_MAX - 0.5f;
    free(values);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    struct ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *pool = ggml_threadpool_new(&pool_params);
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    plan.work_data = malloc(plan.work_size + 64);
    double *samples = malloc(sizeof(double) * calls);
    for (int i = 0; i < calls + 20; i++) {
        const double start = now_us();
        ggml_graph_compute(graph, &plan);
        if (i >= 20) samples[i - 20] = now_us() - start;
    }
    qsort(samples, calls, sizeof(double), by_value);
    printf("%s %d %d %d %.2f\n", ggml_type_name(type), n, k, threads, samples[calls / 2]);
    ggml_threadpool_free(pool);
    ggml_free(ctx);
    return 0;
}
