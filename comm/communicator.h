// Collective communication between the ranks of a job, the same interface on both backends:
// NCCL on its own CUDA stream for `device: cuda`, MPI host collectives for `device: cpu`.
//
// Device collectives (all_reduce, reduce_scatter, all_gather, reduce) take buffers on the
// communicator's device (host memory on cpu). On cuda they are enqueued, never waited for: the
// communication stream first waits for everything already queued on the compute stream, and the
// compute stream waits for the collective before any work queued after it (events both ways).
// Between group_start() and group_end() several collectives form one NCCL group (cpu: no-op).
//
// Host collectives (barrier, the host all-reduces, gather/broadcast of strings) always use MPI
// and block.
//
// Every collective is watched: one that has not finished `timeout` seconds after it was issued
// (the first-step allowance applies until mark_first_step_done()) makes the watchdog log
// "rank R: <operation> '<what>' did not finish within T s", abort the NCCL communicator and the
// whole MPI job (non-zero exit on every rank); a job never hangs silently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/phase_timer.h"

namespace comm {

enum class ReduceOp { sum, avg, max };

// Process placement from the launcher (mpirun, srun with PMIx) or a lone process: world 1.
struct Placement {
  int rank = 0;
  int world = 1;
  int local_rank = 0;  // rank among the processes of this node (MPI_Comm_split_type shared)
  int local_world = 1;
};

// MPI_Init_thread on construction (once per process), MPI_Finalize on destruction.
class Environment {
 public:
  Environment(int* argc, char*** argv);
  ~Environment();
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;
  const Placement& placement() const { return placement_; }

 private:
  Placement placement_;
};

// A collective's clock starts when it is issued (enqueued, on cuda), so the timeout also covers
// the compute queued before it. 0 or less: never times out.
struct CommOptions {
  double timeout_s = 300;              // parallel.timeout_s
  double first_step_timeout_s = 1200;  // until mark_first_step_done()
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return placement_.rank; }
  int world() const { return placement_.world; }
  int local_rank() const { return placement_.local_rank; }

  // In place over `count` elements.
  virtual void all_reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, const char* what) = 0;
  // In place: `data` holds world * count_per_rank elements; afterwards this rank's reduced part is
  // at data + rank * count_per_rank (the rest is undefined).
  virtual void reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, ReduceOp op,
                              const char* what) = 0;
  // In place: this rank's part at data + rank * count_per_rank goes to every rank.
  virtual void all_gather(void* data, core::DType dtype, std::size_t count_per_rank, const char* what) = 0;
  // Out of place: the reduction of every rank's `send` lands in `recv` on `root`; elsewhere `recv`
  // is not touched and may be null. `send` may equal `recv` (in place; other ranks' data is then
  // undefined afterwards).
  virtual void reduce_into(const void* send, void* recv, core::DType dtype, std::size_t count, ReduceOp op, int root,
                           const char* what) = 0;
  // In place: `count` elements of `data` as `root` has them, on every rank (ZeRO-3 gathers a
  // layer's weights piece by piece from the ranks that own them).
  virtual void broadcast(void* data, core::DType dtype, std::size_t count, int root, const char* what) = 0;
  // In place: the reduction of `data` over all ranks lands on `root` (others' data undefined).
  void reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, int root, const char* what) {
    reduce_into(data, data, dtype, count, op, root, what);
  }
  virtual void group_start() {}
  virtual void group_end() {}

  // Ordering with later compute (cuda; on cpu every collective has finished on return, so these
  // do nothing). By default the compute stream waits for each device collective before running
  // anything queued after it. Collectives issued while detached leave it free to run on (ZeRO-2
  // reduces gradients while the backward continues); the caller orders the work that must wait
  // with wait_for(marker()).
  virtual void set_detached(bool detached) { (void)detached; }
  // A marker after every device collective issued so far (0 on cpu).
  virtual std::uint64_t marker() { return 0; }
  // The compute stream waits, on the device, until the collectives before `marker` have finished.
  // The most recent kMarkers markers are kept; waiting for an older one waits for the oldest kept
  // (later in stream order, so it covers the older one too). A marker not yet issued: core::Error.
  virtual void wait_for(std::uint64_t marker) { (void)marker; }
  static constexpr std::uint64_t kMarkers = 16;
  // The communication stream's phase timer (cuda with several ranks; null elsewhere), disabled
  // until the caller enables it: each collective, or each group, is one phase from when it can
  // start (after the compute it waits for) to its end, named by its (first) `what`, which must be
  // a string literal.
  virtual core::PhaseTimer* phase_timer() { return nullptr; }

  // Host collectives (MPI, blocking).
  virtual void barrier(const char* what) = 0;
  virtual double all_reduce_host(double value, ReduceOp op, const char* what) = 0;
  virtual std::vector<double> all_reduce_host(std::vector<double> values, ReduceOp op, const char* what) = 0;
  // Every rank's string, on `root` only (empty vector elsewhere).
  virtual std::vector<std::string> gather_strings(const std::string& mine, int root, const char* what) = 0;
  // `text` as `root` has it, on every rank.
  virtual std::string broadcast_string(const std::string& text, int root, const char* what) = 0;

  // Waits until every enqueued device collective has finished (no-op on cpu).
  virtual void synchronize() = 0;
  // Later collectives get the normal timeout instead of the first-step allowance.
  virtual void mark_first_step_done() = 0;

 protected:
  explicit Communicator(Placement placement) : placement_(placement) {}
  Placement placement_;
};

// Collectives issued while it lives are detached (Communicator::set_detached), also when one throws.
class DetachedScope {
 public:
  explicit DetachedScope(Communicator& comm) : comm_(comm) { comm_.set_detached(true); }
  ~DetachedScope() { comm_.set_detached(false); }
  DetachedScope(const DetachedScope&) = delete;
  DetachedScope& operator=(const DetachedScope&) = delete;

 private:
  Communicator& comm_;
};

// The communicator for `context`'s device: NCCL (the ncclUniqueId broadcast over MPI) on cuda,
// MPI on cpu. With world 1 the collectives are local no-ops (in-place results are already right).
// Collective over all ranks. `environment` and `context` must outlive the communicator; the cpu
// path makes no CUDA call. Unsupported arguments (avg of an integer type, a dtype the backend
// cannot reduce, a root outside the job) throw core::Error on every rank before communicating.
std::unique_ptr<Communicator> make_communicator(const Environment& environment, const core::DeviceContext& context,
                                                CommOptions options);

// The CUDA device this process should use: its local rank modulo the visible GPU count
// (core::Error when `cuda_devices` < 1).
int device_for(const Placement& placement, int cuda_devices);

}  // namespace comm
