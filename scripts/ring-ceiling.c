/*
 * The most any ring in shared memory can move between two CPUs here: one
 * thread copies fixed-size writes from a private buffer into a ring, another
 * copies up to 64 KiB at a time out of it into a private buffer, both
 * busy-polling two cursors, with no protocol, no doorbell and no system
 * call. A stream through smclo (or any shared-memory transport that keeps
 * read() and write() semantics: one copy in, one copy out) cannot beat it.
 *
 *   cc -O2 -pthread -o ring-ceiling scripts/ring-ceiling.c
 *   ./ring-ceiling RING_KIB WRITE_BYTES SECONDS WRITER_CPU READER_CPU
 *
 * prints the throughput in MB/s (10^6 bytes), as sockperf does.
 * docs/bench/bulk-throughput.md has what it measured.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define READ_MAX 65536

static size_t ring_len, write_len;
static char *ring;
/* Bytes written and bytes read, each on its own cache line. */
static _Alignas(64) _Atomic unsigned long long prod;
static _Alignas(64) _Atomic unsigned long long cons;
static _Alignas(64) atomic_int stop;

static void pin(int cpu)
{
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	if (pthread_setaffinity_np(pthread_self(), sizeof s, &s) != 0) {
		fprintf(stderr, "ring-ceiling: cannot run on CPU %d\n", cpu);
		exit(2);
	}
}

static void copy_in(unsigned long long pos, const char *src, size_t n)
{
	size_t off = pos % ring_len, first = n < ring_len - off ? n : ring_len - off;
	memcpy(ring + off, src, first);
	memcpy(ring, src + first, n - first);
}

static void copy_out(unsigned long long pos, char *dst, size_t n)
{
	size_t off = pos % ring_len, first = n < ring_len - off ? n : ring_len - off;
	memcpy(dst, ring + off, first);
	memcpy(dst + first, ring, n - first);
}

static void *writer(void *arg)
{
	pin(*(int *)arg);
	char *buf = malloc(write_len);
	memset(buf, 0x5a, write_len);
	unsigned long long p = 0;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		unsigned long long c = atomic_load_explicit(&cons, memory_order_acquire);
		size_t room = ring_len - (size_t)(p - c);
		size_t n = room < write_len ? room : write_len;
		if (n == 0)
			continue;
		copy_in(p, buf, n);
		p += n;
		atomic_store_explicit(&prod, p, memory_order_release);
	}
	free(buf);
	return NULL;
}

static void *reader(void *arg)
{
	pin(*(int *)arg);
	char *buf = malloc(READ_MAX);
	unsigned long long c = 0;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		unsigned long long p = atomic_load_explicit(&prod, memory_order_acquire);
		size_t n = p - c < READ_MAX ? (size_t)(p - c) : READ_MAX;
		if (n == 0)
			continue;
		copy_out(c, buf, n);
		c += n;
		atomic_store_explicit(&cons, c, memory_order_release);
	}
	free(buf);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: %s RING_KIB WRITE_BYTES SECONDS WRITER_CPU READER_CPU\n", argv[0]);
		return 2;
	}
	ring_len = strtoul(argv[1], NULL, 10) * 1024;
	write_len = strtoul(argv[2], NULL, 10);
	double secs = strtod(argv[3], NULL);
	int cpus[2] = {atoi(argv[4]), atoi(argv[5])};
	if (ring_len == 0 || write_len == 0 || secs <= 0) {
		fprintf(stderr, "ring-ceiling: ring, write size and seconds must be positive\n");
		return 2;
	}
	ring = aligned_alloc(4096, ring_len);
	memset(ring, 0, ring_len);
	pthread_t w, r;
	pthread_create(&w, NULL, writer, &cpus[0]);
	pthread_create(&r, NULL, reader, &cpus[1]);
	struct timespec t0, t1, d = {(time_t)secs, (long)((secs - (time_t)secs) * 1e9)};
	clock_gettime(CLOCK_MONOTONIC, &t0);
	unsigned long long c0 = atomic_load(&cons);
	nanosleep(&d, NULL);
	unsigned long long c1 = atomic_load(&cons);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	atomic_store(&stop, 1);
	pthread_join(w, NULL);
	pthread_join(r, NULL);
	double el = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
	printf("%.1f\n", (c1 - c0) / el / 1e6);
	return 0;
}
