// Graceful stop of a training run on a signal. While a StopSignals object lives, SIGUSR1, SIGTERM
// and a first SIGINT only set an async-signal-safe flag: the loop finishes its current step, saves
// a checkpoint and returns, and the program exits 0. A second SIGINT ends the process at once
// (_exit(130)) without touching the checkpoints already complete on disk.
#pragma once

namespace trainer {

class StopSignals {
 public:
  // Installs the handlers (the previous ones come back on destruction) and clears the flag.
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // A stop was asked for since construction.
  static bool requested();
  // The number of the signal that asked for it (0 when none).
  static int signal_number();
};

}  // namespace trainer
