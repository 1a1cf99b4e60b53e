// The NVMe tier's data path on XLA:CPU: copies between XLA's buffers and the
// tier's slice buffers, called through the XLA FFI.
//
// With `io_callback` alone, every slice crosses jax's callback machinery: the
// arguments are copied into fresh host arrays (page faults and zeroing on each
// new page) and the results copied back, at about 2 GB/s on 2 cores; at the
// tier's bandwidth that is most of a step's CPU time. Instead the read callback
// returns only where the slice it read lies (the address and size of a buffer
// the tier holds until the slice has been written), these handlers copy the
// arrays out of and into it with one memcpy each, and the write callback
// receives a ticket. Layout: array i at byte `offsets[i]`, as the tier laid
// out its reads.
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// `where` is {address, size} of the slice buffer, as uint32 halves, low half
// first: jax without x64 has no 64-bit integers.
uint64_t Word(const uint32_t* w, int i) { return w[2 * i] | uint64_t{w[2 * i + 1]} << 32; }

// The slice buffer's start, after checking that array i of `nbytes` fits in it.
ffi::ErrorOr<char*> Locate(ffi::Buffer<ffi::U32>& where, ffi::Span<const int64_t> offsets,
                           size_t i, size_t nbytes) {
  if (where.element_count() != 4) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("offlax slices: `where` is not 4 words"));
  }
  if (i >= offsets.size() || offsets[i] < 0 ||
      static_cast<uint64_t>(offsets[i]) + nbytes > Word(where.typed_data(), 1)) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "offlax slices: array " + std::to_string(i) + " does not fit in the slice buffer"));
  }
  return reinterpret_cast<char*>(Word(where.typed_data(), 0));
}

// XLA's arrays into the slice buffer; returns a ticket that orders what follows.
ffi::Error ToSliceImpl(ffi::Buffer<ffi::U32> where, ffi::Buffer<ffi::S32> after,
                       ffi::RemainingArgs values, ffi::ResultBuffer<ffi::S32> ticket,
                       ffi::Span<const int64_t> offsets) {
  if (values.size() != offsets.size()) {
    return ffi::Error::InvalidArgument("offlax slices: one offset per array");
  }
  for (size_t i = 0; i < values.size(); ++i) {
    auto value = values.get<ffi::AnyBuffer>(i);
    if (value.has_error()) return value.error();
    auto base = Locate(where, offsets, i, value->size_bytes());
    if (base.has_error()) return base.error();
    std::memcpy(*base + offsets[i], value->untyped_data(), value->size_bytes());
  }
  ticket->typed_data()[0] = after.typed_data()[0];
  return ffi::Error::Success();
}

// The slice buffer into XLA's arrays, and a ticket for the copy back.
ffi::Error FromSliceImpl(ffi::Buffer<ffi::U32> where, ffi::RemainingRets values,
                         ffi::Span<const int64_t> offsets) {
  // The last result is the ticket.
  if (values.size() != offsets.size() + 1) {
    return ffi::Error::InvalidArgument("offlax slices: one offset per array");
  }
  for (size_t i = 0; i < offsets.size(); ++i) {
    auto value = values.get<ffi::AnyBuffer>(i);
    if (value.has_error()) return value.error();
    auto base = Locate(where, offsets, i, (*value)->size_bytes());
    if (base.has_error()) return base.error();
    std::memcpy((*value)->untyped_data(), *base + offsets[i], (*value)->size_bytes());
  }
  auto ticket = values.get<ffi::Buffer<ffi::S32>>(offsets.size());
  if (ticket.has_error()) return ticket.error();
  (*ticket)->typed_data()[0] = 0;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxToSlice, ToSliceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // {address, size}
                                  .Arg<ffi::Buffer<ffi::S32>>()  // FromSlice's ticket
                                  .RemainingArgs()               // the arrays
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ticket
                                  .Attr<ffi::Span<const int64_t>>("offsets"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxFromSlice, FromSliceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // {address, size}
                                  .RemainingRets()               // the arrays, then a ticket
                                  .Attr<ffi::Span<const int64_t>>("offsets"));
