/* Starts PROGRAM with posix_spawnp (this process's environment) and
 * exits with its status.
 *
 * usage: spawn PROGRAM [ARGS...] */
#include <spawn.h>
#include <stdio.h>
#include <sys/wait.h>

extern char **environ;

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: spawn PROGRAM [ARGS...]\n");
        return 2;
    }
    pid_t pid;
    int e = posix_spawnp(&pid, argv[1], NULL, NULL, argv + 1, environ);
    if (e != 0) {
        fprintf(stderr, "posix_spawnp: error %d\n", e);
        return 2;
    }
    int st;
    if (waitpid(pid, &st, 0) != pid)
        return 2;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
