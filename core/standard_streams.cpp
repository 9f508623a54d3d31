#include "core/standard_streams.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <unistd.h>

#include "core/error.h"

namespace core {

ClosedStreams guard_standard_streams() {
  ClosedStreams closed;
  bool* flags[3] = {&closed.in, &closed.out, &closed.err};
  for (int fd = 0; fd < 3; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    *flags[fd] = true;
    // open() returns the lowest free descriptor: this one, as the lower ones are open by now.
    const int opened = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (opened >= 0 && opened != fd) {
      ::dup2(opened, fd);
      ::close(opened);
    }
  }
  if (closed.out) std::clearerr(stdout);
  if (closed.err) std::clearerr(stderr);
  return closed;
}

void finish_standard_output() {
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int error = errno;
    throw Error(std::string("writing standard output: ") + (error != 0 ? std::strerror(error) : "write error"));
  }
}

}  // namespace core
