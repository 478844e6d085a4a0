/* A handler whose mask (sa_mask) blocks every signal, SIGBUS included.
 * Prints what the sigaction query answers, then, inside the handler,
 * whether the kernel's mask blocks SIGBUS and whether the program's view
 * (a sigprocmask query) does, and the same after the handler:
 *   query <0|1>
 *   handler kernel <0|1> view <0|1>
 *   after kernel <0|1> view <0|1>
 * In mode `fault` the handler then touches a page of a file truncated
 * under its mapping: the program dies by SIGBUS, as the kernel deals a
 * fault the thread blocks. */
#include "check.h"
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>

static int fault_mode;

static int kernel_blocks(int sig) {
    FILE *f = fopen("/proc/thread-self/status", "r");
    char line[256];
    unsigned long long blk = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "SigBlk: %llx", &blk) == 1)
            break;
    if (f)
        fclose(f);
    return (int)(blk >> (sig - 1) & 1);
}

static int view_blocks(int sig) {
    sigset_t cur;
    if (sigprocmask(SIG_BLOCK, NULL, &cur) < 0)
        fail("sigprocmask");
    return sigismember(&cur, sig);
}

static void on_usr1(int sig) {
    (void)sig;
    printf("handler kernel %d view %d\n", kernel_blocks(SIGBUS), view_blocks(SIGBUS));
    fflush(stdout);
    if (fault_mode) {
        FILE *t = tmpfile();
        long page = sysconf(_SC_PAGESIZE);
        if (!t || ftruncate(fileno(t), page) < 0)
            fail("tmpfile");
        volatile char *m = mmap(NULL, page, PROT_READ, MAP_SHARED, fileno(t), 0);
        if (m == MAP_FAILED || ftruncate(fileno(t), 0) < 0)
            fail("mmap");
        (void)m[0];
        printf("FAIL survived the fault\n");
    }
}

int main(int argc, char **argv) {
    mode = argc > 1 ? argv[1] : "mask";
    fault_mode = strcmp(mode, "fault") == 0;
    struct sigaction sa = {.sa_handler = on_usr1}, old;
    sigfillset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL) < 0 || sigaction(SIGUSR1, NULL, &old) < 0)
        fail("sigaction");
    printf("query %d\n", sigismember(&old.sa_mask, SIGBUS));
    raise(SIGUSR1);
    printf("after kernel %d view %d\n", kernel_blocks(SIGBUS), view_blocks(SIGBUS));
    return 0;
}
