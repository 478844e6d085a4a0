/* A library whose constructor registers fork handlers. A program linked
 * with it runs the constructor before the preload's, so its prepare handler
 * runs after the preload took its descriptor table's lock for the fork:
 * the way, under test, to keep that lock held while another thread waits;
 * and its child handler runs before the preload's part of the fork in the
 * child: the way to make a child that starts late.
 * late_atfork_arm(fd, ms): the next fork's handler writes one byte to `fd`
 * and sleeps `ms` milliseconds; late_atfork_call(fn): it calls `fn`;
 * late_atfork_hold_children(fd): the children of the forks from now on
 * read one byte from `fd` (-1: none) before they go on. */
#include <pthread.h>
#include <unistd.h>

static volatile int notify_fd = -1;
static volatile int sleep_ms;
static void (*volatile call)(void);

static void prepare(void) {
    void (*f)(void) = call;
    call = NULL;
    if (f) f();
    int fd = notify_fd;
    if (fd < 0) return;
    notify_fd = -1;
    char c = 'p';
    (void)!write(fd, &c, 1);
    usleep((useconds_t)sleep_ms * 1000);
}

static volatile int hold_fd = -1;

static void child(void) {
    char c;
    if (hold_fd >= 0 && read(hold_fd, &c, 1) != 1) _exit(99);
}

__attribute__((constructor)) static void init(void) {
    pthread_atfork(prepare, NULL, child);
}

void late_atfork_hold_children(int fd) {
    hold_fd = fd;
}

void late_atfork_arm(int fd, int ms) {
    sleep_ms = ms;
    notify_fd = fd;
}

void late_atfork_call(void (*fn)(void)) {
    call = fn;
}
