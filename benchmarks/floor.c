/* The futex floor of W1g (benchmarks/gaps.py): a bare ping-pong between two processes
 * after an idle gap, with the same spin-then-park wait on both sides as the engine.
 *
 * Compiled on demand (cc -O2 -shared -fPIC) into a temporary directory and loaded with
 * ctypes; never part of the package build.
 *
 *   parent ("Scheduler")                       child ("SUB worker")
 *   sleep(gap)                                 wait: spin child_spin_ns on `req`,
 *   t0; req += 1; if child_parked: FUTEX_WAKE        then child_parked = 1, FUTEX_WAIT
 *   wait: spin parent_spin_ns on `resp`,       resp += 1; if parent_parked: FUTEX_WAKE
 *         then parent_parked = 1, FUTEX_WAIT
 *   t1 (sample = t1 - t0)
 *
 * A spin is the engine's: pause instructions, the clock read and sched_yield() every 64
 * turns (child_wait in _mailbox.c; the Scheduler yields between short spins too), so a
 * process woken onto the spinner's core runs at once. parent_yields = 0 spins without
 * yielding (as the engine did before its spins yielded): a child woken onto the parent's core then
 * waits for the parent's whole spin. Both parks are Dekker-style (flag, re-check,
 * sleep), like child_wait and the doorbell, so a wake-up costs a syscall only when the
 * other side sleeps. With spins of 0 both sides park at once: two wake-ups.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct shared {
    int32_t req;           /* bumped by the parent: one request */
    int32_t child_parked;
    int32_t resp;          /* bumped by the child: one reply */
    int32_t parent_parked;
    int32_t stop;
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(int32_t *word, int32_t expected)
{
    syscall(SYS_futex, word, FUTEX_WAIT, expected, NULL, NULL, 0);
}

static void futex_wake(int32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* Wait until *word != seen: spin for spin_ns (clock read every 64 turns, like
 * child_wait), then announce in *parked, re-check, and sleep on the futex. */
static void wait_change(int32_t *word, int32_t seen, int32_t *parked, int64_t spin_ns,
                        int yield, const int32_t *stop)
{
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != seen) {
        return;
    }
    if (spin_ns > 0) {
        int64_t deadline = now_ns() + spin_ns;
        for (uint64_t it = 1;; it++) {
            relax();
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != seen) {
                return;
            }
            if ((it & 63) == 0) {
                if (now_ns() >= deadline) {
                    break;
                }
                if (yield) {
                    sched_yield();
                }
            }
        }
    }
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == seen && !__atomic_load_n(stop, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(parked, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == seen) {
            futex_wait(word, seen);
        }
        __atomic_store_n(parked, 0, __ATOMIC_SEQ_CST);
    }
}

static void bump_and_wake(int32_t *word, const int32_t *parked)
{
    __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(parked, __ATOMIC_SEQ_CST)) {
        futex_wake(word);
    }
}

/* n round trips, each after sleeping gap_ns; samples_ns[i] = the i-th round trip.
 * Returns 0, or -errno when the child cannot be forked. The caller's process must
 * run one thread (it forks). */
int floor_pingpong(int64_t gap_ns, int n, int64_t parent_spin_ns, int64_t child_spin_ns,
                   int parent_yields, int64_t *samples_ns)
{
    struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                             -1, 0);
    if (sh == MAP_FAILED) {
        return -errno;
    }
    pid_t pid = fork();
    if (pid < 0) {
        int err = errno;
        munmap(sh, sizeof *sh);
        return -err;
    }
    if (pid == 0) {
        /* A crashed or killed benchmark must not leave this child parked forever. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1) {
            _exit(0);
        }
        int32_t seen = 0;
        for (;;) {
            wait_change(&sh->req, seen, &sh->child_parked, child_spin_ns, 1, &sh->stop);
            if (__atomic_load_n(&sh->stop, __ATOMIC_ACQUIRE)) {
                _exit(0);
            }
            seen = __atomic_load_n(&sh->req, __ATOMIC_ACQUIRE);
            bump_and_wake(&sh->resp, &sh->parent_parked);
        }
    }
    int32_t resp = 0;
    struct timespec gap = {gap_ns / 1000000000LL, gap_ns % 1000000000LL};
    for (int i = 0; i < n; i++) {
        if (gap_ns > 0) {
            nanosleep(&gap, NULL);
        }
        int64_t t0 = now_ns();
        bump_and_wake(&sh->req, &sh->child_parked);
        wait_change(&sh->resp, resp, &sh->parent_parked, parent_spin_ns, parent_yields,
                    &sh->stop);
        samples_ns[i] = now_ns() - t0;
        resp = __atomic_load_n(&sh->resp, __ATOMIC_ACQUIRE);
    }
    __atomic_store_n(&sh->stop, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&sh->req, 1, __ATOMIC_SEQ_CST);
    futex_wake(&sh->req);
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    munmap(sh, sizeof *sh);
    return 0;
}
