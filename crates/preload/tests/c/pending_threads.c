/* Two threads of one client process, each with a non-blocking connect
 * waited on with poll, as libpq's clients (pgbench -j 2) do: both
 * proposals name the process's one rendezvous socket. Thread B connects
 * and sleeps in poll for ever; thread A connects after it and polls with
 * no timeout in a loop for 20 ms, then sleeps in poll; meanwhile the
 * server (a child process on another CPU) accepts B's connection and
 * connects to the rendezvous socket for B's proposal. A and B share one
 * CPU and A runs first (SCHED_FIFO), as a loaded machine may leave B
 * waiting for a CPU: A's look takes the server's connection off the
 * socket and files it for B, whose poll then sleeps on (the socket is no
 * longer readable). B must still take it in time: the server waits for
 * B's DMB for SMCLO_CLC_WAIT_MS, then keeps TCP (TIMEOUT).
 *
 * Usage: pending_threads ROUNDS. Prints "OK <bytes read>" when every
 * connection carried its bytes; the test counts the device's connections
 * and fallbacks. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
	perror(what);
	exit(1);
}

static int port;
/* Thread B -> thread A: B's connect returned. */
static int b_connected[2];
/* Thread A -> server: both connects are made, accept. */
static int go[2];
static long bytes;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void server(int l, int rounds) {
	for (int r = 0; r < rounds; r++) {
		char c;
		if (read(go[0], &c, 1) != 1)
			die("server: read go");
		for (int i = 0; i < 2; i++) {
			int s = accept(l, NULL, NULL);
			if (s < 0)
				die("accept");
			char b = 'x';
			if (write(s, &b, 1) != 1 || read(s, &b, 1) != 1 || b != 'y')
				die("server: exchange");
			close(s);
		}
	}
	exit(0);
}

static long ms_since(struct timespec *t0) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* The calling thread runs on `cpu` only. */
static void pin(int cpu) {
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof set, &set) < 0)
		die("sched_setaffinity");
}

/* The first two CPUs this process may run on. */
static int cpus[2];

static void pick_cpus(void) {
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof set, &set) < 0)
		die("sched_getaffinity");
	int n = 0;
	for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
		if (CPU_ISSET(c, &set))
			cpus[n++] = c;
	if (n < 2) {
		fprintf(stderr, "needs two CPUs\n");
		exit(1);
	}
}

/* A non-blocking connect to the server. */
static int start_connect(void) {
	int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	if (s < 0)
		die("socket");
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (connect(s, (struct sockaddr *)&a, sizeof a) == 0 || errno != EINPROGRESS)
		die("connect: expected EINPROGRESS");
	return s;
}

/* Waits for `ev` on `s`, 5 s at most: polls with no timeout for `spin_ms`
 * (-1: none), then sleeps in poll. */
static void wait_for(int s, short ev, int spin_ms) {
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		struct pollfd p = {.fd = s, .events = ev};
		int n = poll(&p, 1, ms_since(&t0) < spin_ms ? 0 : -1);
		if (n < 0 && errno != EINTR)
			die("poll");
		if (n > 0 && (p.revents & ev))
			return;
		if (n > 0) {
			fprintf(stderr, "poll: revents %#x\n", p.revents);
			exit(1);
		}
		if (ms_since(&t0) > 5000) {
			fprintf(stderr, "poll: nothing in 5 s\n");
			exit(1);
		}
	}
}

/* The connection's exchange once connected. */
static void finish(int s) {
	int err = 0;
	socklen_t len = sizeof err;
	if (getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err != 0)
		die("connect failed");
	wait_for(s, POLLIN, -1);
	char b;
	if (read(s, &b, 1) != 1 || b != 'x')
		die("client: read");
	b = 'y';
	if (write(s, &b, 1) != 1)
		die("client: write");
	close(s);
	pthread_mutex_lock(&mu);
	bytes += 1;
	pthread_mutex_unlock(&mu);
}

static void *thread_b(void *arg) {
	int rounds = *(int *)arg;
	pin(cpus[0]);
	for (int r = 0; r < rounds; r++) {
		int s = start_connect();
		if (write(b_connected[1], "b", 1) != 1)
			die("write b_connected");
		wait_for(s, POLLOUT, -1);
		finish(s);
	}
	return NULL;
}

static void thread_a(int rounds) {
	pin(cpus[0]);
	struct sched_param sp = {.sched_priority = 1};
	if (sched_setscheduler(0, SCHED_FIFO, &sp) < 0)
		die("sched_setscheduler SCHED_FIFO (needs root)");
	for (int r = 0; r < rounds; r++) {
		char c;
		if (read(b_connected[0], &c, 1) != 1)
			die("read b_connected");
		/* B is asleep in poll by now. */
		usleep(2000);
		int s = start_connect();
		if (write(go[1], "g", 1) != 1)
			die("write go");
		wait_for(s, POLLOUT, 20);
		finish(s);
	}
}

int main(int argc, char **argv) {
	int rounds = argc > 1 ? atoi(argv[1]) : 20;
	pick_cpus();
	if (pipe(b_connected) < 0 || pipe(go) < 0)
		die("pipe");
	int ready[2];
	if (pipe(ready) < 0)
		die("pipe");
	pid_t child = fork();
	if (child < 0)
		die("fork");
	if (child == 0) {
		pin(cpus[1]);
		int l = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in a = {.sin_family = AF_INET};
		a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		socklen_t len = sizeof a;
		if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 16) < 0 ||
		    getsockname(l, (struct sockaddr *)&a, &len) < 0)
			die("listen");
		int p = ntohs(a.sin_port);
		if (write(ready[1], &p, sizeof p) != sizeof p)
			die("write port");
		server(l, rounds);
	}
	if (read(ready[0], &port, sizeof port) != sizeof port)
		die("read port");
	pthread_t tb;
	if (pthread_create(&tb, NULL, thread_b, &rounds) != 0)
		die("pthread_create");
	thread_a(rounds);
	pthread_join(tb, NULL);
	int st;
	if (waitpid(child, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		fprintf(stderr, "server failed\n");
		return 1;
	}
	printf("OK %ld\n", bytes);
	return 0;
}
