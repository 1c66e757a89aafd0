/*
 * simpler_daemon.mailbox._mailbox -- what the extension's source files share: the frame
 * layout, the inline word/futex/buffer helpers every entry point uses, the argument
 * converters (_mailbox_args.c) and the entry points the method table (_mailbox.c)
 * lists.  One extension module; the split is by concept only.
 */
#ifndef SIMPLER_DAEMON_MAILBOX_H
#define SIMPLER_DAEMON_MAILBOX_H

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef __linux__
#error "simpler_daemon.mailbox._mailbox supports Linux only"
#endif

/* ------------------------------------------------------------------------ */
/* Layout                                                                   */
/* ------------------------------------------------------------------------ */

#define ABI_VERSION 1

#define MAILBOX_FRAME_SIZE 65536
#define MAILBOX_NUM_FRAMES 3
#define MAILBOX_SIZE 196608

#define OFF_STATE 0          /* i32 */
#define OFF_ERROR 4          /* i32 */
#define OFF_RESERVED 8       /* u64: task 0 / base-frame control sub-command */
#define OFF_CONFIG 16
#define CONFIG_SIZE 1056
#define OFF_LEASE 1072       /* u32 slot_id, u32 reserved, u64 generation */
#define LEASE_SIZE 16
#define OFF_DIGEST 1088
#define DIGEST_SIZE 32
#define OFF_ARGS 1120
#define MAILBOX_ARGS_CAPACITY 64080
#define OFF_WAKE_SEQ 65200   /* i32, base frame only: futex word */
#define OFF_CHILD_PARKED 65208 /* i32, base frame only */
/* The doorbell (mailbox/doorbell.py): the parent's parked flag and the completion count
 * every child bumps, in a small shared mapping of their own. */
#define DOORBELL_OFF_PARKED 0
#define DOORBELL_OFF_COMPLETED 8
#define DOORBELL_SIZE 16
#define OFF_SHUTDOWN 65216   /* i32, base frame only, sticky */
#define OFF_TRAILER 65224    /* 5 x u64 */
#define TRAILER_SIZE 40
#define OFF_ACCEPTED 65264   /* i32 */
#define OFF_DISPOSITION 65272 /* i32 */
#define OFF_ERRMSG 65280
#define ERRMSG_SIZE 256

#define TENSOR_DESC_SIZE 168
#define ARGS_HEADER_SIZE 8   /* i32 T, i32 S */
/* A values section may follow the scalars (simpler_daemon/taskvalues.py):
 * [u32 magic][u32 where][u64 V][u64 K][u64 heap_offset], then V + K bytes when where is 0.
 * Every publish zeroes the 4 bytes after its blob, so a magic there is this task's. */
#define VALUES_MAGIC 0x31564453u
#define VALUES_SECTION_SIZE 32

#define STATE_IDLE 0
#define STATE_TASK_READY 1
#define STATE_TASK_DONE 2
#define STATE_SHUTDOWN 3
#define STATE_CONTROL_REQUEST 4
#define STATE_CONTROL_DONE 5
#define STATE_INIT_READY 6
#define STATE_INIT_FAILED 7
#define STATE_FRAME_STAGED 8
#define STATE_TASK_LAUNCHED 9
#define STATE_TASK_FAILED 10
#define STATE_ACTIVATE 11
#define STATE_PREPARE_READY 12

#define SPIN_WAIT_MAX_WORDS 8

_Static_assert(MAILBOX_FRAME_SIZE * MAILBOX_NUM_FRAMES == MAILBOX_SIZE, "mailbox size");
_Static_assert(OFF_STATE + 4 <= OFF_ERROR, "state/error overlap");
_Static_assert(OFF_ERROR + 4 <= OFF_RESERVED, "error/reserved overlap");
_Static_assert(OFF_RESERVED % 8 == 0, "reserved must be 8-aligned");
_Static_assert(OFF_RESERVED + 8 <= OFF_CONFIG, "reserved/config overlap");
_Static_assert(OFF_CONFIG + CONFIG_SIZE <= OFF_LEASE, "config/lease overlap");
_Static_assert(OFF_LEASE % 8 == 0, "lease must be 8-aligned");
_Static_assert((OFF_LEASE + 8) % 8 == 0, "lease generation must be 8-aligned");
_Static_assert(OFF_LEASE + LEASE_SIZE <= OFF_DIGEST, "lease/digest overlap");
_Static_assert(OFF_DIGEST + DIGEST_SIZE <= OFF_ARGS, "digest/args overlap");
_Static_assert(OFF_ARGS % 8 == 0, "args must be 8-aligned");
_Static_assert(OFF_ARGS + MAILBOX_ARGS_CAPACITY <= OFF_WAKE_SEQ, "args/wake_seq overlap");
_Static_assert(OFF_WAKE_SEQ % 4 == 0, "wake_seq must be 4-aligned");
_Static_assert(OFF_WAKE_SEQ + 4 <= OFF_CHILD_PARKED, "wake_seq/child_parked overlap");
_Static_assert(OFF_CHILD_PARKED % 4 == 0, "child_parked must be 4-aligned");
_Static_assert(OFF_CHILD_PARKED + 4 <= OFF_SHUTDOWN, "child_parked/shutdown overlap");
_Static_assert(OFF_SHUTDOWN % 4 == 0, "shutdown must be 4-aligned");
_Static_assert(OFF_SHUTDOWN + 4 <= OFF_TRAILER, "shutdown/trailer overlap");
_Static_assert(OFF_TRAILER % 8 == 0, "trailer must be 8-aligned");
_Static_assert(TRAILER_SIZE == 5 * 8, "trailer is 5 x u64");
_Static_assert(OFF_TRAILER + TRAILER_SIZE <= OFF_ACCEPTED, "trailer/accepted overlap");
_Static_assert(OFF_ACCEPTED % 4 == 0, "accepted must be 4-aligned");
_Static_assert(OFF_ACCEPTED + 4 <= OFF_DISPOSITION, "accepted/disposition overlap");
_Static_assert(OFF_DISPOSITION % 4 == 0, "disposition must be 4-aligned");
_Static_assert(OFF_DISPOSITION + 4 <= OFF_ERRMSG, "disposition/errmsg overlap");
_Static_assert(OFF_ERRMSG + ERRMSG_SIZE <= MAILBOX_FRAME_SIZE, "errmsg overflows the frame");
_Static_assert(ARGS_HEADER_SIZE <= MAILBOX_ARGS_CAPACITY, "args header");
_Static_assert(sizeof(int32_t) == 4 && sizeof(uint64_t) == 8, "word sizes");

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

static inline long
sys_futex_wait(int32_t *addr, int32_t expected, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, FUTEX_WAIT, expected, ts, NULL, 0);
}

static inline long
sys_futex_wake(int32_t *addr, int n)
{
    return syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

static inline int
get_buf(PyObject *obj, Py_buffer *view)
{
    return PyObject_GetBuffer(obj, view, PyBUF_WRITABLE);
}

/* Pointer to a width-byte word at off, or NULL with IndexError/ValueError. */
static inline void *
word_ptr(Py_buffer *view, Py_ssize_t off, Py_ssize_t width)
{
    if (off < 0 || width > view->len || off > view->len - width) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd out of range for %zd-byte word in buffer of %zd bytes",
                     off, width, view->len);
        return NULL;
    }
    char *p = (char *)view->buf + off;
    if (((uintptr_t)p) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not %zd-byte aligned", off, width);
        return NULL;
    }
    return p;
}

/* Pointer to an n-byte range at off (no alignment requirement). */
static inline char *
range_ptr(Py_buffer *view, Py_ssize_t off, Py_ssize_t n)
{
    if (off < 0 || n > view->len || off > view->len - n) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd out of range for %zd-byte range in buffer of %zd bytes",
                     off, n, view->len);
        return NULL;
    }
    return (char *)view->buf + off;
}

/* Pointer to the frame at frame_off; the buffer must also hold the base
 * frame at offset 0 and be 8-byte aligned at its start. */
static inline char *
frame_ptr(Py_buffer *view, Py_ssize_t frame_off)
{
    if (frame_off % MAILBOX_FRAME_SIZE != 0) {
        PyErr_Format(PyExc_ValueError, "frame offset %zd is not a multiple of %d", frame_off,
                     MAILBOX_FRAME_SIZE);
        return NULL;
    }
    if (view->len < MAILBOX_FRAME_SIZE) {
        PyErr_Format(PyExc_IndexError,
                     "buffer of %zd bytes does not hold the base frame (%d bytes)", view->len,
                     MAILBOX_FRAME_SIZE);
        return NULL;
    }
    if (frame_off < 0 || frame_off > view->len - MAILBOX_FRAME_SIZE) {
        PyErr_Format(PyExc_IndexError,
                     "frame offset %zd out of range for %d-byte frame in buffer of %zd bytes",
                     frame_off, MAILBOX_FRAME_SIZE, view->len);
        return NULL;
    }
    if (((uintptr_t)view->buf) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "mailbox buffer is not 8-byte aligned");
        return NULL;
    }
    return (char *)view->buf + frame_off;
}

/* The base frame (offset 0) of a whole mailbox, for park/wake words. */
static inline char *
base_ptr(Py_buffer *view)
{
    return frame_ptr(view, 0);
}

#define I32_AT(base, off) ((int32_t *)((char *)(base) + (off)))
#define U32_AT(base, off) ((uint32_t *)((char *)(base) + (off)))
#define U64_AT(base, off) ((uint64_t *)((char *)(base) + (off)))

/* Parent side of the Dekker park/wake handshake; `base` is the base frame.
 * The caller has already published (seq_cst store) whatever the child waits
 * on.  Returns 1 if the child was parked and has been woken. */
static inline int
wake_child_impl(char *base)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(I32_AT(base, OFF_CHILD_PARKED), __ATOMIC_SEQ_CST) != 0) {
        __atomic_fetch_add(I32_AT(base, OFF_WAKE_SEQ), 1, __ATOMIC_SEQ_CST);
        (void)sys_futex_wake(I32_AT(base, OFF_WAKE_SEQ), INT_MAX);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* SUB pump lane layout (_mailbox_pump.c; the sizes are module constants)   */
/* ------------------------------------------------------------------------ */

#define SUBPUMP_BUF 0
#define SUBPUMP_OFF 1
#define SUBPUMP_SLOT 2
#define SUBPUMP_DID 3
#define SUBPUMP_NEXT 4
#define SUBPUMP_AT 5
#define SUBPUMP_STOP 6
#define SUBPUMP_DONE 7
#define SUBPUMP_PEER 8
#define SUBPUMP_FIELDS 9
#define SUBPUMP_MAX_LANES 256
#define SUBPUMP_MAX_RESULT 32768
#define SUBPUMP_PROTOCOL 0x534C5231ULL

/* ------------------------------------------------------------------------ */
/* Argument converters (_mailbox_args.c; usable with "O&" and directly)     */
/* ------------------------------------------------------------------------ */

/* Timeout in seconds: None -> forever (has_timeout = 0). */
typedef struct {
    int has_timeout;
    struct timespec ts;
} timeout_t;

int mb_conv_off(PyObject *obj, void *out);
int mb_conv_count(PyObject *obj, void *out);
int mb_conv_w32(PyObject *obj, void *out);
int mb_conv_u32(PyObject *obj, void *out);
int mb_conv_w64(PyObject *obj, void *out);
int mb_conv_u64(PyObject *obj, void *out);
int mb_conv_timeout(PyObject *obj, void *out);
PyObject *mb_steal_tuple(Py_ssize_t n, PyObject **items);
int mb_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want);

/* ------------------------------------------------------------------------ */
/* Entry points (the method table in _mailbox.c)                            */
/* ------------------------------------------------------------------------ */

/* _mailbox_atomics.c */
PyObject *mb_load32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_load64(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_store32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_store64(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_cas32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_cas64(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_fetch_add32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_fetch_add64(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_fence(PyObject *m, PyObject *ignored);
PyObject *mb_futex_wait(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_futex_wake(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* _mailbox_wait.c */
PyObject *mb_spin_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_child_wait(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_wake_child(PyObject *m, PyObject *buf);
PyObject *mb_child_claim(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* _mailbox_frame.c */
PyObject *mb_publish_task(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_read_task(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_child_take(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_child_done(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *mb_read_trailer(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_write_result(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_read_result(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_read_bytes(PyObject *m, PyObject *args, PyObject *kwargs);
PyObject *mb_write_bytes(PyObject *m, PyObject *args, PyObject *kwargs);

/* _mailbox_process.c */
PyObject *mb_set_pdeathsig(PyObject *m, PyObject *arg);
PyObject *mb_fork_sibling(PyObject *m, PyObject *arg);

/* _mailbox_gc.c */
PyObject *mb_gc_untrack(PyObject *m, PyObject *obj);
PyObject *mb_gc_track_all(PyObject *m, PyObject *seq);

/* _mailbox_pump.c */
PyObject *mb_sub_pump(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
/* Interns the attribute names the pump reads; called from the module's exec slot. */
int mb_pump_init(void);

#endif /* SIMPLER_DAEMON_MAILBOX_H */
