/* Calls the Go self test from the main thread and from a C thread. */
#include <pthread.h>
#include <stdio.h>

extern int mcb_te_selftest(char *lib);

static void *run(void *lib) {
    return (void *)(long)mcb_te_selftest(lib);
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    int rc = mcb_te_selftest(argv[1]);
    pthread_t t;
    void *trc = (void *)1;
    if (rc == 0 && pthread_create(&t, NULL, run, argv[1]) == 0)
        pthread_join(t, &trc);
    rc = rc || trc != NULL;
    printf(rc ? "selftest failed\n" : "selftest ok\n");
    return rc;
}
