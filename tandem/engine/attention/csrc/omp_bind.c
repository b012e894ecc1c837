/* Binding the OpenMP thread pool of the calling thread to CPUs, one thread per CPU (what vLLM's CPU worker does
 * for VLLM_CPU_OMP_THREADS_BIND). torch's intra-op parallelism and tandem's kernels run on the same libgomp in the
 * process, whose worker threads persist between parallel regions: binding the team of one region of n threads binds
 * the threads every later region of at most n threads (from the same calling thread) runs on. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Thread i of a team of n binds itself to cpus[i] and writes its kernel thread id to tids[i] (tids may be NULL).
 * Returns the number of threads whose sched_setaffinity failed, or -1 when the team had fewer than n threads. */
int tandem_omp_bind(const int *cpus, int n, int *tids) {
    int failed = 0, team = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        int i = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
            failed += 1;
        else {
            CPU_SET(cpus[i], &set);
            if (sched_setaffinity(0, sizeof(set), &set) != 0)
                failed += 1;
        }
        if (tids)
            tids[i] = (int)syscall(SYS_gettid);
#pragma omp single
        team = omp_get_num_threads();
    }
    return team < n ? -1 : failed;
}

/* The kernel thread ids of the team of one parallel region of n threads (tids[0..n-1]); returns the team's size. */
int tandem_omp_team(int n, int *tids) {
    int team = 0;
#pragma omp parallel num_threads(n)
    {
        tids[omp_get_thread_num()] = (int)syscall(SYS_gettid);
#pragma omp single
        team = omp_get_num_threads();
    }
    return team;
}
