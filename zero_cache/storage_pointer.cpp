// Points a storage at memory it does not own (storage_pointer.py): torch before 2.13 has no Python API
// for it. Only inline members of c10's public StorageImpl header are used.
#include <c10/core/StorageImpl.h>

extern "C" void zero_cache_point_storage(void* storage_impl, void* ptr, size_t nbytes, int device_type,
                                         int device_index) {
  auto* impl = static_cast<c10::StorageImpl*>(storage_impl);
  c10::Device device(static_cast<c10::DeviceType>(device_type), static_cast<c10::DeviceIndex>(device_index));
  // A DataPtr without a deleter: the memory stays its owner's. The one replaced is dropped here, which frees
  // what the storage owned, as a resize to zero does.
  impl->set_data_ptr_noswap(c10::DataPtr(ptr, device));
  impl->set_nbytes(nbytes);
}
