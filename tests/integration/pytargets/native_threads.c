/* Threads that Python did not start, for pytargets/thread_target.py: one that calls cudaMalloc itself
 * (it never has a Python thread state), and one that calls back into Python (ctypes makes it a thread state
 * for each call and deletes it after). */
#include <pthread.h>
#include <stddef.h>

typedef int (*alloc_fn)(void **pointer, size_t size_bytes);
typedef void (*callback_fn)(int index);

struct job {
    alloc_fn alloc;       /* called directly, or */
    callback_fn callback; /* called back */
    int calls;
    size_t size_bytes;
    void **pointers;
    int *results;
};

static void *run(void *argument) {
    struct job *job = argument;
    for (int i = 0; i < job->calls; i++) {
        if (job->alloc)
            job->results[i] = job->alloc(&job->pointers[i], job->size_bytes);
        else
            job->callback(i);
    }
    return NULL;
}

static int in_new_thread(struct job *job) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, run, job) != 0)
        return -1;
    return pthread_join(thread, NULL);
}

int alloc_in_native_thread(alloc_fn alloc, int calls, size_t size_bytes, void **pointers, int *results) {
    struct job job = {alloc, NULL, calls, size_bytes, pointers, results};
    return in_new_thread(&job);
}

int call_back_in_native_thread(callback_fn callback, int calls) {
    struct job job = {NULL, callback, calls, 0, NULL, NULL};
    return in_new_thread(&job);
}
