/* core_to_core.c — the round trip of one cache line between two CPUs, in nanoseconds.
 *
 *   cc -O2 -pthread -o core_to_core bench/core_to_core.c
 *   ./core_to_core [CPU_A CPU_B [ROUND_TRIPS]]    # prints e.g. "62"
 *
 * Without CPUs it takes the first two this process may run on (its affinity mask): the two
 * that the benchmarks' pinned pairs use.
 * Two threads, pinned to CPU_A and CPU_B, hand a counter back and forth through one
 * 64-byte-aligned atomic word; the figure is the median of 9 batches of ROUND_TRIPS
 * (default 20,000) round trips. Every shm transfer and every loopback TCP segment between
 * two pinned processes crosses between the same two CPUs, so when a virtual machine's
 * CPUs land on cores far apart (another core complex or socket of the host) the fabric
 * and reference figures both slow down by the same cause. The benchmark scripts run this
 * around each measurement and print it, so that figures taken with the CPUs near each
 * other are not compared with figures taken with them far apart. Exits 1 when a thread
 * cannot be pinned (the figure would not be about those two CPUs).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BATCHES 9

static _Alignas(64) _Atomic long word;
static long trips = 20000;
static int cpu_b;

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* The far side: answers every odd value with the next even one. */
static void *answer(void *arg) {
  (void)arg;
  if (pin(cpu_b) != 0) {
    atomic_store(&word, -1);
    return NULL;
  }
  for (long i = 0; i < BATCHES * trips; i++) {
    long v;
    while ((v = atomic_load_explicit(&word, memory_order_acquire)) != 2 * i + 1) {
      if (v < 0) return NULL;
    }
    atomic_store_explicit(&word, 2 * i + 2, memory_order_release);
  }
  return NULL;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int cpu_a = -1;
  cpu_b = -1;
  if (argc >= 3) {
    cpu_a = atoi(argv[1]);
    cpu_b = atoi(argv[2]);
  } else if (argc == 1) {
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0) {
      for (int c = 0; c < CPU_SETSIZE && cpu_b < 0; c++) {
        if (!CPU_ISSET(c, &mine)) continue;
        if (cpu_a < 0) cpu_a = c; else cpu_b = c;
      }
    }
    if (cpu_b < 0) {
      fprintf(stderr, "core_to_core: fewer than two CPUs to run on\n");
      return 1;
    }
  } else {
    fprintf(stderr, "usage: %s [CPU_A CPU_B [ROUND_TRIPS]]\n", argv[0]);
    return 2;
  }
  if (argc > 3) trips = atol(argv[3]);
  if (trips < 1) trips = 1;
  if (pin(cpu_a) != 0) {
    fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", cpu_a);
    return 1;
  }
  pthread_t t;
  if (pthread_create(&t, NULL, answer, NULL) != 0) {
    fprintf(stderr, "core_to_core: cannot start a thread\n");
    return 1;
  }
  double ns[BATCHES];
  long i = 0;
  for (int b = 0; b < BATCHES; b++) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < trips; k++, i++) {
      atomic_store_explicit(&word, 2 * i + 1, memory_order_release);
      long v;
      while ((v = atomic_load_explicit(&word, memory_order_acquire)) != 2 * i + 2) {
        if (v < 0) goto failed;
      }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ns[b] = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / trips;
  }
  pthread_join(t, NULL);
  qsort(ns, BATCHES, sizeof ns[0], cmp);
  printf("%.0f\n", ns[BATCHES / 2]);
  return 0;
failed:
  pthread_join(t, NULL);
  fprintf(stderr, "core_to_core: cannot pin to CPU %d\n", cpu_b);
  return 1;
}
