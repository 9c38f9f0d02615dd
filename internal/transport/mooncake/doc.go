// Package mooncake binds Mooncake Transfer Engine's C API (or the mock TE,
// which implements the same ABI) through purego and implements
// transport.Transport on top of it.
//
// The library is opened at run time from a path (Config.Library, or the
// MCB_MOONCAKE_LIB environment variable), never linked: the real
// libtransfer_engine.so is a C++ build that most hosts do not have. Before it
// is opened, the file and its DT_NEEDED closure are inspected, and a library
// that would bring a second Go runtime into the process (a USE_ETCD build
// links libetcd_wrapper.so, a Go c-shared library) is refused. It is opened
// RTLD_LOCAL, and before that the binding sets what the real library reads
// from the environment where the host has not (MC_LOG_LEVEL=WARNING,
// MC_TCP_ENABLE_CONNECTION_POOL=1; see libraryEnvironment).
//
// The binding hides the C API's hazards from the host process: batch ids are
// raw pointers that the library hands out again once freed, so a Batch frees
// its id exactly once and refuses every use after that before calling the
// library; metadata strings the library cannot serve are refused before the
// library sees them (the real engine aborts the process on them);
// enableGracefulShutdown, which installs process-wide signal handlers, is
// never called. Both of the library's error conventions (positive Status codes
// and negative int codes) become bridge status codes.
//
// A hung peer costs a caller at most its deadline. Calls that wait on a peer
// (OpenSegment, SyncSegmentCache, SendNotify, and polls of a batch whose
// notification is pending) run on a goroutine of their own and return
// status.Timeout at the caller's deadline (OpenSegmentContext) or the
// engine's Config.PeerTimeout, while the call goes on inside the library
// until the library gives up; Close leaves destroying the engine to the last
// such call to return. submitTransfer and getTransferStatus otherwise never
// wait on a peer, and transport.Wait bounds the wait for a transfer.
//
// Only linux/amd64 and linux/arm64 are supported: the layouts mirrored here
// are those of LP64 Linux.
package mooncake
