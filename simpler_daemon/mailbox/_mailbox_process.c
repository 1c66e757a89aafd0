/*
 * simpler_daemon.mailbox._mailbox: process controls.
 *
 * The two process-level calls the children need: PR_SET_PDEATHSIG and a
 * CLONE_PARENT fork for the fork server.
 */

#include "_mailbox.h"

PyObject *
mb_set_pdeathsig(PyObject *Py_UNUSED(m), PyObject *arg)
{
    long signum = PyLong_AsLong(arg);
    if (signum == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (signum < 0 || signum > INT_MAX) {
        errno = EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)signum, 0UL, 0UL, 0UL) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}


/* fork_sibling() -> int: fork a child of this process's parent (clone(CLONE_PARENT)).
 *
 * The fork server uses it: a replacement child becomes the Worker's own child, so the
 * Worker reaps it (and sees its real wait status) and it outlives a fork server that
 * dies. Same bookkeeping as os.fork() (PyOS_BeforeFork / AfterFork); the caller must
 * be single-threaded. Returns 0 in the child, the pid in the caller. */
PyObject *
mb_fork_sibling(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(arg))
{
    PyOS_BeforeFork();
    long pid = syscall(SYS_clone, (unsigned long)(CLONE_PARENT | SIGCHLD), 0UL, NULL, NULL, 0UL);
    int saved_errno = errno;
    if (pid == 0) {
        PyOS_AfterFork_Child();
    }
    else {
        PyOS_AfterFork_Parent();
    }
    if (pid < 0) {
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(pid);
}
