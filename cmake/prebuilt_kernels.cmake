# The CUDA kernels' objects compiled on another machine (scripts/pack-kernels.sh), so that
# the device harness (scripts/device-run.sh) links them instead of spending minutes of a
# short GPU session compiling them. They are used only where their stamp is this tree's: a
# hash of the compile settings and of every file under src/ and include/ (more than the
# kernels include, so that no dependency is missed) and of the build files. Otherwise the
# kernels are compiled as usual, with a warning. The host compiler is left out of the stamp:
# the device's differs from the packing machine's by design. The objects' host code calls
# the CUDA runtime and libstdc++ (std::string, exceptions), so the device's libstdc++ must be
# as new as the packing machine's (GCC 13.3 there, 12.2 here).
# When the objects are used, every hashed file is a configure dependency (an edit re-runs
# CMake, whose stamp then refuses them), and they are linked from copies in the build folder
# that change (and relink) only when their content does.
#
# In:  flashdelta_kernel_sources; FLASHDELTA_PREBUILT_KERNELS (a folder, or empty).
# Out: flashdelta_kernels_stamp, also written to <build>/flashdelta_kernels.stamp for the
#      packing script; flashdelta_prebuilt_kernel_objects (empty unless the folder's are used);
#      FLASHDELTA_PREBUILT_KERNELS_USED in the cache (the harness reports it).

set(FLASHDELTA_PREBUILT_KERNELS "" CACHE PATH
    "A folder of the CUDA kernels' objects from scripts/pack-kernels.sh (used where its stamp matches)")

file(GLOB_RECURSE _fd_inputs LIST_DIRECTORIES false CONFIGURE_DEPENDS
     RELATIVE ${CMAKE_CURRENT_SOURCE_DIR}
     ${CMAKE_CURRENT_SOURCE_DIR}/src/* ${CMAKE_CURRENT_SOURCE_DIR}/include/*)
list(SORT _fd_inputs)
list(PREPEND _fd_inputs CMakeLists.txt cmake/prebuilt_kernels.cmake)
string(TOUPPER "${CMAKE_BUILD_TYPE}" _fd_config)
set(_fd_text "nvcc ${CMAKE_CUDA_COMPILER_VERSION}\narch ${CMAKE_CUDA_ARCHITECTURES}\n")
string(APPEND _fd_text "config ${CMAKE_BUILD_TYPE}\nflags ${CMAKE_CUDA_FLAGS} ${CMAKE_CUDA_FLAGS_${_fd_config}}\n")
string(APPEND _fd_text "separable ${CMAKE_CUDA_SEPARABLE_COMPILATION}\n")
foreach(_fd_var NVCC_PREPEND_FLAGS NVCC_APPEND_FLAGS NVCC_CCBIN)
  string(APPEND _fd_text "${_fd_var} $ENV{${_fd_var}}\n")
endforeach()
foreach(_fd_file ${_fd_inputs})
  file(SHA256 ${CMAKE_CURRENT_SOURCE_DIR}/${_fd_file} _fd_hash)
  string(APPEND _fd_text "${_fd_hash} ${_fd_file}\n")
endforeach()
string(SHA256 flashdelta_kernels_stamp "${_fd_text}")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/flashdelta_kernels.stamp "${flashdelta_kernels_stamp}\n")

set(flashdelta_prebuilt_kernel_objects "")
get_property(_fd_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
if(FLASHDELTA_PREBUILT_KERNELS)
  set(_fd_dir "${FLASHDELTA_PREBUILT_KERNELS}")
  set(_fd_theirs "none")
  if(EXISTS ${_fd_dir}/flashdelta_kernels.stamp)
    file(STRINGS ${_fd_dir}/flashdelta_kernels.stamp _fd_theirs LIMIT_COUNT 1)
    # Another archive unpacked into the folder re-runs CMake.
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
                 ${_fd_dir}/flashdelta_kernels.stamp)
  endif()
  # The objects are named after their sources: <name>.cu.o.
  set(_fd_names "")
  set(_fd_missing "")
  foreach(_fd_source ${flashdelta_kernel_sources})
    get_filename_component(_fd_name ${_fd_source} NAME)
    list(APPEND _fd_names ${_fd_name}.o)
    if(NOT EXISTS ${_fd_dir}/${_fd_name}.o)
      list(APPEND _fd_missing ${_fd_name}.o)
    endif()
  endforeach()
  if(_fd_multi_config)
    message(WARNING "FLASHDELTA_PREBUILT_KERNELS: a multi-config generator builds several "
                    "configurations from one set of objects; compiling the kernels")
  elseif(NOT _fd_theirs STREQUAL flashdelta_kernels_stamp)
    message(WARNING "FLASHDELTA_PREBUILT_KERNELS=${_fd_dir}: its stamp ${_fd_theirs} is not "
                    "this tree's ${flashdelta_kernels_stamp}; compiling the kernels")
  elseif(_fd_missing)
    message(WARNING "FLASHDELTA_PREBUILT_KERNELS=${_fd_dir} lacks ${_fd_missing}; "
                    "compiling the kernels")
  else()
    foreach(_fd_name ${_fd_names})
      set(_fd_copy ${CMAKE_CURRENT_BINARY_DIR}/prebuilt_kernels/${_fd_name})
      configure_file(${_fd_dir}/${_fd_name} ${_fd_copy} COPYONLY)
      list(APPEND flashdelta_prebuilt_kernel_objects ${_fd_copy})
    endforeach()
    list(TRANSFORM _fd_inputs PREPEND ${CMAKE_CURRENT_SOURCE_DIR}/ OUTPUT_VARIABLE _fd_paths)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_fd_paths})
    message(STATUS "FlashDelta: the CUDA kernels prebuilt in ${_fd_dir} (stamp ${flashdelta_kernels_stamp})")
  endif()
endif()
if(flashdelta_prebuilt_kernel_objects)
  set(FLASHDELTA_PREBUILT_KERNELS_USED ON CACHE INTERNAL "")
else()
  set(FLASHDELTA_PREBUILT_KERNELS_USED OFF CACHE INTERNAL "")
endif()
