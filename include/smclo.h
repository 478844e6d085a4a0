/*
 * smclo.h - C API of smclo: TCP connections between processes on one host,
 * upgraded out of band to shared-memory rings (SMC-D loopback in user
 * space), with plain TCP as the fallback.
 *
 * Link with -lsmclo (libsmclo.so or libsmclo.a from the smclo-capi crate).
 *
 * Conventions, the same for every function:
 *  - errors are reported as NULL or -1 with errno set: the OS error when
 *    there is one, otherwise the closest errno (EINVAL, EAGAIN, ...), EIO as
 *    the last resort;
 *  - every pointer argument is checked; NULL gives EINVAL (smclo_close and
 *    smclo_listener_close accept NULL and do nothing);
 *  - an internal panic is caught and reported as EIO, never unwinds into C;
 *  - settings come from the environment (SMCLO_DEVICE_DIR, SMCLO_RMEM,
 *    SMCLO_WMEM, SMCLO_CLC_WAIT_MS, SMCLO_UEID, SMCLO_DEBUG), read when a
 *    listener or connection is created.
 *
 * Both ends of a connection must be in different processes for it to use
 * shared memory: a connection within one process stays TCP.
 *
 * Threads: a stream may be used from several threads at once (for example
 * one reading, one writing), except smclo_close, which must be the last
 * call. A zero-copy region must be ended on the thread that started it.
 *
 * Zero-copy rules (smclo_reserve/smclo_commit, smclo_peek/smclo_release):
 *  - at most one region is outstanding per direction; starting a second one
 *    fails with EBUSY;
 *  - smclo_commit ends a reserved region, smclo_release ends a peeked one,
 *    whether they succeed or not; the pointer is invalid afterwards;
 *  - while a reserved region is outstanding, smclo_write fails with EBUSY;
 *    while a peeked region is outstanding, smclo_read fails with EBUSY;
 *  - smclo_close drops an outstanding region (nothing more is sent or
 *    consumed) and invalidates its pointer;
 *  - on an SMC-D connection a region is memory shared with the peer
 *    process, which an honest peer does not touch while the region is
 *    outstanding but a misbehaving one can change at any time. Read a
 *    peeked byte once: copy what you parse or check before parsing or
 *    checking it (a value read twice may differ). Do not read back bytes
 *    you wrote into a reserved region expecting the same values. Such a
 *    peer can only garble the bytes of its own connection; it cannot make
 *    the region's pointer or size invalid.
 */
#ifndef SMCLO_H
#define SMCLO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <signal.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A listening socket. */
typedef struct smclo_listener smclo_listener;

/** A connected stream: shared memory (SMC-D) or plain TCP. */
typedef struct smclo_stream smclo_stream;

/** SMC decline code: the peer does not run smclo. */
#define SMCLO_REASON_PEERNOSMC 0x03010000u

/* ----- listener ---------------------------------------------------------- */

/**
 * Binds host:port (a name or an address; port 0 picks a free port), listens,
 * and announces the listener to smclo clients on this host.
 * Returns NULL with errno on error.
 */
smclo_listener *smclo_listen(const char *host, uint16_t port);

/**
 * Accepts one connection whose handshake decided: the stream uses shared
 * memory if the client runs smclo, TCP otherwise. Non-blocking, it never
 * waits on a client: a handshake that goes on is returned by a later call.
 * Returns NULL with errno on error (EAGAIN when non-blocking and nothing
 * has decided). A fork child accepting after the process that made the
 * listener closed it or exited registers it again at its first client that
 * did not propose: that connection stays TCP, the next ones use shared
 * memory.
 */
smclo_stream *smclo_accept(smclo_listener *l);

/**
 * The descriptor to poll() for smclo_accept: readable when it may return a
 * connection (a pending one, or a handshake that may have decided). An
 * epoll set, not the listening socket. Owned by the listener: do not close
 * it. -1 with errno on error.
 */
int smclo_listener_fd(const smclo_listener *l);

/** The bound port (useful after port 0); 0 with errno on error. */
uint16_t smclo_listener_port(const smclo_listener *l);

/** Non-blocking smclo_accept when on != 0. 0, or -1 with errno. */
int smclo_listener_set_nonblocking(smclo_listener *l, int on);

/** Closes and frees the listener (NULL: no-op); accepted streams stay open,
 * connections whose handshake was still going on are reset. */
void smclo_listener_close(smclo_listener *l);

/* ----- stream ------------------------------------------------------------ */

/**
 * Connects to host:port; the connection uses shared memory if the server
 * runs smclo on this host, plain TCP otherwise (see smclo_fallback_reason).
 * Returns NULL with errno on error.
 */
smclo_stream *smclo_connect(const char *host, uint16_t port);

/**
 * The descriptor to poll(): readable/writable exactly when smclo_read /
 * smclo_write would make progress. Owned by the stream: never close, read or
 * write it. -1 with errno on error.
 */
int smclo_fd(const smclo_stream *s);

/** 1 if the connection uses shared memory, 0 if plain TCP, -1 on error. */
int smclo_is_smc(const smclo_stream *s);

/**
 * Why the connection is plain TCP: the SMC decline code (for example
 * SMCLO_REASON_PEERNOSMC), 0 when it uses shared memory.
 */
uint32_t smclo_fallback_reason(const smclo_stream *s);

/**
 * The short name of a decline code ("PEERNOSMC"), "-" for 0, "UNKNOWN" for a
 * code this library does not know. Static string: never free it.
 */
const char *smclo_reason_name(uint32_t code);

/**
 * Reads up to len bytes like read(2): the count, 0 at end of stream, -1 with
 * errno (EAGAIN when non-blocking and nothing is there; EBUSY while a peeked
 * region is outstanding).
 */
ssize_t smclo_read(smclo_stream *s, void *buf, size_t len);

/**
 * Writes up to len bytes like write(2): the count (possibly short), -1 with
 * errno (EAGAIN when non-blocking and there is no room; EPIPE after the peer
 * closed; EBUSY while a reserved region is outstanding). Never raises
 * SIGPIPE.
 */
ssize_t smclo_write(smclo_stream *s, const void *buf, size_t len);

/**
 * Non-blocking mode when on != 0: reads, writes, reserves and peeks fail
 * with EAGAIN instead of waiting. 0, or -1 with errno.
 */
int smclo_set_nonblocking(smclo_stream *s, int on);

/**
 * Half-close: the peer reads everything written so far, then end of stream;
 * this end can still read. 0, or -1 with errno.
 */
int smclo_shutdown_write(smclo_stream *s);

/**
 * Closes the connection and frees the stream (NULL: no-op). An outstanding
 * region is dropped first and its pointer becomes invalid.
 */
void smclo_close(smclo_stream *s);

/* ----- zero copy --------------------------------------------------------- */

/**
 * Zero-copy send, step 1: a writable region of at least min bytes (min at
 * most the ring size; 0 means 1) directly inside the peer's receive ring
 * (a local buffer on a TCP connection); *len gets its size. Waits for room
 * unless non-blocking. NULL with errno on error (EAGAIN, EBUSY, EINVAL when
 * min exceeds the ring, EPIPE).
 */
void *smclo_reserve(smclo_stream *s, size_t min, size_t *len);

/**
 * Zero-copy send, step 2: sends the first n bytes of the reserved region
 * (n <= its size; 0 sends nothing) and ends the region. 0, or -1 with errno
 * (EINVAL when no region is outstanding or n is too big).
 */
int smclo_commit(smclo_stream *s, size_t n);

/**
 * Zero-copy receive, step 1: the received bytes in place, *len gets their
 * count. Waits for data unless non-blocking. At end of stream the result is
 * non-NULL with *len == 0, still a region to end with smclo_release(s, 0).
 * NULL with errno on error (EAGAIN, EBUSY).
 */
const void *smclo_peek(smclo_stream *s, size_t *len);

/**
 * Zero-copy receive, step 2: consumes the first n bytes of the peeked region
 * (n <= its size; the rest is seen again by the next read or peek) and ends
 * the region. 0, or -1 with errno (EINVAL when no region is outstanding or n
 * is too big).
 */
int smclo_release(smclo_stream *s, size_t n);

/* ----- poller ------------------------------------------------------------ */

/**
 * One wait over several streams (and other descriptors) with the event-loop
 * fast path: a shared-memory stream is answered by its ring without a
 * system call; a wait with nothing ready spins briefly (SMCLO_SPIN_US,
 * adaptive) while the peers skip their wake-ups, then sleeps in the kernel.
 * TCP streams and other descriptors are answered by the kernel. Calls on
 * one poller are serialized (use it from one thread at a time). A stream
 * must be removed from every poller before smclo_close.
 */
typedef struct smclo_poller smclo_poller;

/** One ready registration. */
typedef struct smclo_event {
    uint64_t token;  /* as given to smclo_poller_add */
    uint32_t events; /* poll(2)'s bits: POLLIN, POLLOUT, POLLHUP, POLLERR, POLLRDHUP */
} smclo_event;

/** A new, empty poller; NULL with errno on error. */
smclo_poller *smclo_poller_new(void);

/**
 * Waits for events (POLLIN, POLLOUT, POLLRDHUP) on s, reported with token;
 * adding a stream again changes its events and token. 0, or -1 with errno.
 */
int smclo_poller_add(smclo_poller *p, const smclo_stream *s, uint32_t events, uint64_t token);

/** The same for another descriptor (a listener's, a pipe). 0, or -1. */
int smclo_poller_add_fd(smclo_poller *p, int fd, uint32_t events, uint64_t token);

/** Stops waiting on s. 0, or -1 with errno (ENOENT: not registered). */
int smclo_poller_remove(smclo_poller *p, const smclo_stream *s);

/** Stops waiting on descriptor fd. 0, or -1 with errno (ENOENT). */
int smclo_poller_remove_fd(smclo_poller *p, int fd);

/**
 * Waits at most timeout_ms (negative: for ever) until a registration is
 * ready; writes at most max ready ones to out and returns their number (0
 * after the timeout), -1 with errno (EINTR when a signal handler ended the
 * wait). Level-triggered: what stays ready is reported again (when more
 * are ready than fit, the next call starts after the last reported).
 */
int smclo_poller_wait(smclo_poller *p, smclo_event *out, int max, int timeout_ms);

/** Frees the poller (NULL: no-op); its streams stay open. */
void smclo_poller_free(smclo_poller *p);

/* ----- signals ----------------------------------------------------------- */

/**
 * Call from every signal handler the program installs (async-signal-safe):
 * a blocking read or write, or smclo_poller_wait, that is spinning in this
 * thread before it would sleep then fails with EINTR, as the kernel's sleep
 * would have; without it the handler runs and the wait goes on to sleep.
 */
void smclo_signal_handler_ran(int sig);

/**
 * smclo installs a SIGBUS handler when it first maps a shared file (the
 * device, a DMB): another process of the device's users that truncates
 * such a file then resets connections instead of killing the process. A
 * program that installs its own SIGBUS handler after that calls this first
 * from it, with the kernel's siginfo (async-signal-safe): 1 means the
 * fault was in smclo's mappings and is recovered (return from the
 * handler), 0 that it is the program's own.
 */
int smclo_fault_recover(const siginfo_t *info);

#ifdef __cplusplus
}
#endif

#endif /* SMCLO_H */
