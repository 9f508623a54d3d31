// The handlers behind StopSignals: they touch only sig_atomic_t flags and call _exit, both
// async-signal-safe.
#include "trainer/stop_signals.h"

#include <csignal>

#include <unistd.h>

namespace trainer {

namespace {

volatile std::sig_atomic_t stop_signal = 0;  // the first stopping signal's number, 0 when none
volatile std::sig_atomic_t interrupts = 0;   // SIGINTs received

struct sigaction previous_usr1, previous_term, previous_int;

void on_stop_signal(int signal_number) {
  if (signal_number == SIGINT) {
    interrupts = interrupts + 1;
    if (interrupts >= 2) _exit(130);
  }
  if (stop_signal == 0) stop_signal = signal_number;
}

}  // namespace

StopSignals::StopSignals() {
  stop_signal = 0;
  interrupts = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &action, &previous_usr1);
  sigaction(SIGTERM, &action, &previous_term);
  sigaction(SIGINT, &action, &previous_int);
}

StopSignals::~StopSignals() {
  sigaction(SIGUSR1, &previous_usr1, nullptr);
  sigaction(SIGTERM, &previous_term, nullptr);
  sigaction(SIGINT, &previous_int, nullptr);
}

bool StopSignals::requested() { return stop_signal != 0; }

int StopSignals::signal_number() { return stop_signal; }

}  // namespace trainer
