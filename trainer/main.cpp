// trainer CONFIG.yaml [a.b=value ...]: the training program (trainer/cli.h).
#include "trainer/cli.h"

int main(int argc, char** argv) { return trainer::trainer_main(argc, argv); }
