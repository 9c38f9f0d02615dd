// Package mooncake binds Mooncake Store's C client (libmooncake_store.so,
// the 19 mooncake_store_* functions of store_c.h) through purego, and runs
// the store's master (mooncake_master) as a child process.
//
// The library is opened at run time from a path (Config.Library, or
// MCB_MOONCAKE_STORE_LIB), never linked, RTLD_LOCAL: it whole-archives the
// store client, a Transfer Engine, asio and yalantinglibs, and exports only
// the C API. Before it is mapped, the file and its DT_NEEDED closure are
// checked as the Transfer Engine binding checks its library (a build with
// the etcd or Kubernetes-lease backends links a Go c-shared wrapper, which
// would start a second Go runtime; it is refused). One symbol table is
// loaded once per file; the functions this binding can do without are
// resolved without failing the load; every call goes through one gate that
// refuses a missing symbol instead of jumping to address 0.
//
// What the library does to the process, measured on the build of
// scripts/mooncake/build.sh store (TestSideEffects keeps it measured):
//
//   - Loading it sets SIGPIPE to SIG_IGN (a static constructor): from then
//     on, a write to a closed pipe or socket returns EPIPE in every thread,
//     Go's included, instead of killing the process.
//   - setup starts about 25 threads (RPC client, heartbeat, transfer
//     workers, TCP listener, metrics); destroy stops most of them and takes
//     about 2 s (a heartbeat sleep), about 12 s while the master is
//     unreachable (it retries the unmount). Close therefore waits for destroy
//     only up to a deadline (Config.CloseTimeout), then leaves it running.
//   - It logs through glog to stderr: INFO lines by default, a few per
//     call. The binding sets MC_LOG_LEVEL=WARNING where the host has not (as
//     the Transfer Engine binding does; its embedded engine reads the same
//     variable and the TCP connection-pool switch). "Local segment
//     descriptor not found" at setup is an error line it always prints.
//   - Calls that reach the master wait on it: with the master gone an RPC
//     fails after about 4 s (-900 RPC_FAIL), with it stopped (SIGSTOP) after
//     the RPC timeout. The binding sets MC_RPC_TIMEOUT_MS and
//     MC_RPC_CONNECT_TIMEOUT_MS where unset (rpcTimeoutMS), runs every such
//     call on a goroutine of its own and returns status.Timeout at the
//     caller's deadline while the call goes on; buffers it writes into stay
//     the caller's problem until the call lands (Op.Done). health_check does
//     not reach the master (it reports the heartbeat thread's view, 1 s
//     pings, three misses), so Healthy answers at once.
//   - A client that mounts a segment listens on two TCP ports: the engine's
//     handshake port and its TCP transport's data port, which serve the
//     segment without authentication. Upstream binds them to every
//     interface; the build carries the Transfer Engine's listen patch, so
//     both bind local_hostname's host. With metadata on a server the
//     handshake port binds MC_TCP_BIND_ADDRESS, else the host's first
//     non-loopback address: the binding sets it to local_hostname's host
//     where the host has not (one address per process).
//     TestClientListensWhereConfigured checks both kinds of metadata.
//   - mooncake_store_init_all is not bound: it hard-wires an etcd metadata
//     server at 127.0.0.1:2379 and a segment name, neither of which this
//     project runs.
//
// Only linux/amd64 and linux/arm64 are supported: the layouts mirrored here
// are those of LP64 Linux; elsewhere Load and Open return
// status.Unsupported (unsupported.go).
package mooncake
