# Default CUDA architectures: the GPU present (read with nvidia-smi), else Hopper (90a).
# Override with -DCMAKE_CUDA_ARCHITECTURES="80;86;90a" (kernels build for 80, 86 and 90a).
if(DEFINED CMAKE_CUDA_ARCHITECTURES OR DEFINED ENV{CUDAARCHS})
  return()
endif()
set(_llmtrain_arch "90a")
find_program(_llmtrain_nvidia_smi nvidia-smi)
if(_llmtrain_nvidia_smi)
  execute_process(COMMAND ${_llmtrain_nvidia_smi} --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE _llmtrain_cc RESULT_VARIABLE _llmtrain_rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_llmtrain_rc EQUAL 0 AND _llmtrain_cc MATCHES "^([0-9]+)\\.([0-9]+)")
    set(_llmtrain_arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    if(_llmtrain_arch STREQUAL "90")
      set(_llmtrain_arch "90a")  # Hopper: keep wgmma/setmaxnreg available
    endif()
  endif()
endif()
set(CMAKE_CUDA_ARCHITECTURES "${_llmtrain_arch}" CACHE STRING "CUDA architectures")
message(STATUS "CUDA architectures: ${CMAKE_CUDA_ARCHITECTURES}")
