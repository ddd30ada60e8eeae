/* mpi_allreduce.c: times MPI_Allreduce (float sum, out of place) with the sizes, iteration
 * counts, input values and columns of examples/allreduce.rs, for bench/allreduce-vs-mpi.sh.
 *
 *   mpirun -np 2 ./mpi_allreduce [--min-bytes N] [--max-bytes N] [--iters N] [--warmup N]
 *                                [--check 0|1]
 *
 * Time is rank 0's mean over the timed iterations (after a barrier); algbw = bytes / time,
 * busbw = algbw * 2(n-1)/n, in GB/s (1e9 B/s). Exits 1 on a wrong element. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float input(int rank, size_t i) { return (float)((i % 997) + 3 * (size_t)rank + 1); }

static float expected(int n, size_t i) {
    return (float)((size_t)n * (i % 997) + 3 * (size_t)n * (size_t)(n - 1) / 2 + (size_t)n);
}

static size_t default_iters(size_t bytes) {
    size_t it = ((size_t)1 << 30) / (bytes ? bytes : 1);
    if (it < 5) it = 5;
    if (it > 10000) it = 10000;
    return it;
}

int main(int argc, char **argv) {
    size_t min = 4, max = (size_t)256 << 20, iters_opt = 0, warm_opt = 0;
    int check = 1;
    MPI_Init(&argc, &argv);
    for (int i = 1; i + 1 < argc; i += 2) {
        size_t v = strtoull(argv[i + 1], NULL, 0);
        if (!strcmp(argv[i], "--min-bytes")) min = v;
        else if (!strcmp(argv[i], "--max-bytes")) max = v;
        else if (!strcmp(argv[i], "--iters")) iters_opt = v;
        else if (!strcmp(argv[i], "--warmup")) warm_opt = v;
        else if (!strcmp(argv[i], "--check")) check = (int)v;
        else {
            fprintf(stderr, "mpi_allreduce: unknown option %s\n", argv[i]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t maxcount = max / 4 ? max / 4 : 1;
    float *in = malloc(maxcount * sizeof(float)), *out = malloc(maxcount * sizeof(float));
    if (!in || !out) {
        fprintf(stderr, "mpi_allreduce: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < maxcount; i++) in[i] = input(rank, i);
    if (rank == 0) {
        printf("# mpi allreduce: %d ranks, MPI_FLOAT MPI_SUM, out of place\n", n);
        printf("# %10s %11s %8s %6s %11s %9s %9s %6s\n", "size(B)", "count", "iters", "algo",
               "time(us)", "algbw", "busbw", "check");
    }
    size_t s = 4;
    while (s < min) s *= 2;
    for (; s <= max; s *= 2) {
        int count = (int)(s / 4);
        size_t iters = iters_opt ? iters_opt : default_iters(s);
        size_t warm = warm_opt ? warm_opt : (iters / 10 ? iters / 10 : 1);
        for (size_t k = 0; k < warm; k++)
            MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (size_t k = 0; k < iters; k++)
            MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double us = (MPI_Wtime() - t0) * 1e6 / (double)iters;
        const char *ck = "-";
        if (check) {
            memset(out, 0xff, s);
            MPI_Barrier(MPI_COMM_WORLD);
            MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            for (int i = 0; i < count; i++) {
                if (out[i] != expected(n, (size_t)i)) {
                    fprintf(stderr, "mpi_allreduce: rank %d: wrong result at %zu B, element %d\n",
                            rank, s, i);
                    MPI_Abort(MPI_COMM_WORLD, 1);
                }
            }
            ck = "ok";
        }
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = (double)s / us / 1e3;
            double busbw = algbw * 2.0 * (n - 1) / n;
            printf("  %10zu %11d %8zu %6s %11.2f %9.3f %9.3f %6s\n", s, count, iters, "mpi", us,
                   algbw, busbw, ck);
            fflush(stdout);
        }
    }
    free(in);
    free(out);
    MPI_Finalize();
    return 0;
}
