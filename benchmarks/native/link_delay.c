/* Emulated link latency for benchmarks/pipeline.py: LD_PRELOAD this into a process and every message it sends
 * over a socket leaves LINK_DELAY_US microseconds late, the ring's all-reduces (MLX's) and the pipeline's
 * hand-offs (Python's) alike. A send within LINK_DELAY_GAP_US of the thread's previous one continues the same
 * message (a large array goes out in many sends) and is not delayed again. The sender waits out the delay,
 * where a real link would let it go on computing: an upper bound on what the latency costs. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static long delay_us = -1, gap_us = 200;
static __thread long last_send_us = -1000000000L;

static long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000L + t.tv_nsec / 1000;
}

static void wait_for_the_link(void) {
    if (delay_us < 0) {
        const char *delay = getenv("LINK_DELAY_US"), *gap = getenv("LINK_DELAY_GAP_US");
        delay_us = delay ? atol(delay) : 0;
        gap_us = gap ? atol(gap) : gap_us;
    }
    if (delay_us > 0 && now_us() - last_send_us > gap_us)
        usleep((useconds_t)delay_us);
    last_send_us = now_us();
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real) real = dlsym(RTLD_NEXT, "send");
    wait_for_the_link();
    return real(fd, buf, len, flags);
}

ssize_t sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t to_len) {
    static ssize_t (*real)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
    if (!real) real = dlsym(RTLD_NEXT, "sendto");
    wait_for_the_link();
    return real(fd, buf, len, flags, to, to_len);
}

ssize_t sendmsg(int fd, const struct msghdr *message, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real) real = dlsym(RTLD_NEXT, "sendmsg");
    wait_for_the_link();
    return real(fd, message, flags);
}

ssize_t write(int fd, const void *buf, size_t len) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "write");
    struct stat status;
    if (fstat(fd, &status) == 0 && S_ISSOCK(status.st_mode))
        wait_for_the_link();
    return real(fd, buf, len);
}
