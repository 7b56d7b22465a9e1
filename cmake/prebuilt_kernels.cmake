# The CUDA kernels' objects compiled on another machine (scripts/pack-kernels.sh), so that
# the device harness (scripts/device-run.sh) links them instead of spending minutes of a
# short GPU session compiling them. They are used only where their stamp is this tree's: a
# hash of the compile settings and of every file under src/ and include/ (more than the
# kernels include, so that no dependency is missed) and of the build files. Otherwise the
# kernels are compiled as usual, with a warning. The host compiler is left out of the stamp:
# the objects' host code is plain C++ calls into the CUDA runtime, and the device's compiler
# differs from the packing machine's.
#
# In:  flashdelta_kernel_sources; FLASHDELTA_PREBUILT_KERNELS (a folder, or empty).
# Out: flashdelta_kernels_stamp, also written to <build>/flashdelta_kernels.stamp for the
#      packing script; flashdelta_prebuilt_kernel_objects (empty unless the folder's are used).

set(FLASHDELTA_PREBUILT_KERNELS "" CACHE PATH
    "A folder of the CUDA kernels' objects from scripts/pack-kernels.sh (used where its stamp matches)")

file(GLOB_RECURSE _fd_inputs LIST_DIRECTORIES false RELATIVE ${CMAKE_CURRENT_SOURCE_DIR}
     ${CMAKE_CURRENT_SOURCE_DIR}/src/* ${CMAKE_CURRENT_SOURCE_DIR}/include/*)
list(SORT _fd_inputs)
string(TOUPPER "${CMAKE_BUILD_TYPE}" _fd_config)
set(_fd_text "nvcc ${CMAKE_CUDA_COMPILER_VERSION}\narch ${CMAKE_CUDA_ARCHITECTURES}\n")
string(APPEND _fd_text "config ${CMAKE_BUILD_TYPE}\nflags ${CMAKE_CUDA_FLAGS} ${CMAKE_CUDA_FLAGS_${_fd_config}}\n")
foreach(_fd_file CMakeLists.txt cmake/prebuilt_kernels.cmake ${_fd_inputs})
  file(SHA256 ${CMAKE_CURRENT_SOURCE_DIR}/${_fd_file} _fd_hash)
  string(APPEND _fd_text "${_fd_hash} ${_fd_file}\n")
endforeach()
string(SHA256 flashdelta_kernels_stamp "${_fd_text}")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/flashdelta_kernels.stamp "${flashdelta_kernels_stamp}\n")

set(flashdelta_prebuilt_kernel_objects "")
if(FLASHDELTA_PREBUILT_KERNELS)
  get_filename_component(_fd_dir "${FLASHDELTA_PREBUILT_KERNELS}" ABSOLUTE
                         BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  set(_fd_theirs "none")
  if(EXISTS ${_fd_dir}/flashdelta_kernels.stamp)
    file(STRINGS ${_fd_dir}/flashdelta_kernels.stamp _fd_theirs LIMIT_COUNT 1)
  endif()
  set(_fd_objects "")
  set(_fd_missing "")
  foreach(_fd_source ${flashdelta_kernel_sources})
    get_filename_component(_fd_name ${_fd_source} NAME)
    if(EXISTS ${_fd_dir}/${_fd_name}.o)
      list(APPEND _fd_objects ${_fd_dir}/${_fd_name}.o)
    else()
      list(APPEND _fd_missing ${_fd_name}.o)
    endif()
  endforeach()
  if(NOT _fd_theirs STREQUAL flashdelta_kernels_stamp)
    message(WARNING "FLASHDELTA_PREBUILT_KERNELS=${_fd_dir}: its stamp ${_fd_theirs} is not "
                    "this tree's ${flashdelta_kernels_stamp}; compiling the kernels")
  elseif(_fd_missing)
    message(WARNING "FLASHDELTA_PREBUILT_KERNELS=${_fd_dir} lacks ${_fd_missing}; "
                    "compiling the kernels")
  else()
    set(flashdelta_prebuilt_kernel_objects ${_fd_objects})
    message(STATUS "FlashDelta: the CUDA kernels prebuilt in ${_fd_dir} (stamp ${flashdelta_kernels_stamp})")
  endif()
endif()
