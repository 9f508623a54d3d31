// The standard streams of a command-line tool. A stream closed by the caller (`tool >&-`) leaves
// its descriptor free, so the next file the tool opens would take it and a later printf or read
// of that stream would go to the file: guard_standard_streams() points closed ones at /dev/null
// before anything is opened. finish_standard_output() makes a failed write of stdout (a full
// disk, a closed pipe) an error instead of a silent exit 0.
#pragma once

namespace core {

struct ClosedStreams {
  bool in = false, out = false, err = false;
};

// Call first in main(): reports which of stdin, stdout and stderr were closed (now /dev/null).
ClosedStreams guard_standard_streams();

// Flushes stdout; throws core::Error ("writing standard output: REASON") when any write failed.
void finish_standard_output();

}  // namespace core
