// The safetensors reader (mmap, the whole header validated first) and writer (io/safetensors.h).
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "core/error.h"

namespace k3 {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Closes a descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

struct Range {
  uint64_t begin, end;
  const std::string* name;
};

// One tensor entry of the header: validated dtype, shape and byte range.
TensorView parse_entry(const std::string& path, const std::string& name, const json& e, const unsigned char* data,
                       uint64_t data_bytes, uint64_t& begin, uint64_t& end) {
  K3_CHECK(e.is_object(), "{}: tensor {}: header entry is a JSON {}, not an object", path, name, e.type_name());

  auto dt = e.find("dtype");
  K3_CHECK(dt != e.end() && dt->is_string(), "{}: tensor {}: missing or non-string \"dtype\"", path, name);
  auto dtype = dtype_from_name(dt->get_ref<const std::string&>());
  K3_CHECK(dtype.has_value(), "{}: tensor {}: unknown dtype \"{}\"", path, name, dt->get_ref<const std::string&>());

  auto sh = e.find("shape");
  K3_CHECK(sh != e.end() && sh->is_array(), "{}: tensor {}: missing or non-array \"shape\"", path, name);
  Shape shape;
  bool has_zero = false;
  for (const auto& d : *sh) {
    K3_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
             "{}: tensor {}: shape {} has a dimension that is not a non-negative integer", path, name, sh->dump());
    shape.push_back(d.get<int64_t>());
    has_zero = has_zero || shape.back() == 0;
  }
  // Bytes the shape needs, with overflow detected (a zero dimension makes any shape empty).
  uint64_t need = has_zero ? 0 : dtype_size(*dtype);
  bool overflow = false;
  if (!has_zero)
    for (int64_t d : shape) overflow = overflow || __builtin_mul_overflow(need, uint64_t(d), &need);
  overflow = overflow || need > uint64_t(std::numeric_limits<int64_t>::max());
  K3_CHECK(!overflow, "{}: tensor {}: shape {} of {} is too large", path, name, shape_str(shape),
           dtype_name(*dtype));

  auto off = e.find("data_offsets");
  K3_CHECK(off != e.end() && off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
               (*off)[1].is_number_unsigned(),
           "{}: tensor {}: \"data_offsets\" must be [begin, end] of non-negative integers, got {}", path, name,
           off == e.end() ? std::string("nothing") : off->dump());
  begin = (*off)[0].get<uint64_t>();
  end = (*off)[1].get<uint64_t>();
  K3_CHECK(begin <= end, "{}: tensor {}: data_offsets [{}, {}] begin after end", path, name, begin, end);
  K3_CHECK(end <= data_bytes, "{}: tensor {}: data_offsets [{}, {}] end beyond the {} bytes of data (file truncated?)",
           path, name, begin, end, data_bytes);
  K3_CHECK(end - begin == need, "{}: tensor {}: data_offsets [{}, {}] hold {} bytes, shape {} of {} needs {}", path,
           name, begin, end, end - begin, shape_str(shape), dtype_name(*dtype), need);
  return TensorView{data + begin, *dtype, std::move(shape)};
}

}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  K3_CHECK(fd.fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  K3_CHECK(::fstat(fd.fd, &st) == 0, "{}: cannot stat: {}", path, std::strerror(errno));
  K3_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", path);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  K3_CHECK(file_bytes >= 8, "{}: file of {} bytes is shorter than the 8-byte header size", path, file_bytes);

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  K3_CHECK(map != MAP_FAILED, "{}: cannot mmap {} bytes: {}", path, file_bytes, std::strerror(errno));
  f->map_ = map;
  f->map_bytes_ = file_bytes;
  const auto* bytes = static_cast<const unsigned char*>(map);

  const uint64_t n = read_u64_le(bytes);
  K3_CHECK(n <= kMaxHeaderBytes, "{}: header size {} exceeds the {} byte limit", path, n, kMaxHeaderBytes);
  K3_CHECK(8 + n <= file_bytes, "{}: header size {} runs past the end of the {}-byte file", path, n, file_bytes);

  // Parse, rejecting a tensor name that appears twice (nlohmann would keep the last silently).
  std::set<std::string> top_keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && !top_keys.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + n, cb);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path, e.what());
  }
  K3_CHECK(header.is_object(), "{}: header is a JSON {}, not an object", path, header.type_name());
  K3_CHECK(duplicate.empty(), "{}: tensor {}: listed twice in the header", path, duplicate);

  const unsigned char* data = bytes + 8 + n;
  const uint64_t data_bytes = file_bytes - 8 - n;
  std::vector<Range> ranges;
  for (const auto& [name, e] : header.items()) {
    if (name == kMetadataKey) {
      K3_CHECK(e.is_object(), "{}: {} is a JSON {}, not an object", path, kMetadataKey, e.type_name());
      for (const auto& [k, v] : e.items()) {
        K3_CHECK(v.is_string(), "{}: {} key {} holds a JSON {}, not a string", path, kMetadataKey, k, v.type_name());
        f->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    uint64_t begin = 0, end = 0;
    TensorView view = parse_entry(path, name, e, data, data_bytes, begin, end);
    auto it = f->tensors_.emplace(name, std::move(view)).first;
    if (end > begin) ranges.push_back({begin, end, &it->first});
  }

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& a = ranges[i - 1];
    const Range& b = ranges[i];
    K3_CHECK(a.end <= b.begin, "{}: tensor {}: data_offsets [{}, {}] overlap tensor {} at [{}, {}]", path, *b.name,
             b.begin, b.end, *a.name, a.begin, a.end);
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

TensorView SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  K3_CHECK(it != tensors_.end(), "{}: no tensor {}", path_, name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // The header is assembled entry by entry so that tensors keep the given order.
  auto dump = [&](const json& j) {
    try {
      return j.dump();
    } catch (const json::exception& e) {
      fail("{}: cannot write the header: {}", path, e.what());
    }
  };
  std::string text = "{";
  if (!metadata.empty()) text += dump(kMetadataKey) + ":" + dump(metadata);
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    K3_CHECK(name != kMetadataKey, "{}: a tensor cannot be named {}", path, kMetadataKey);
    K3_CHECK(seen.insert(name).second, "{}: tensor {}: given twice", path, name);
    for (int64_t d : t.shape)
      K3_CHECK(d >= 0, "{}: tensor {}: negative dimension in shape {}", path, name, shape_str(t.shape));
    const uint64_t nbytes = t.nbytes();
    K3_CHECK(nbytes == 0 || t.data != nullptr, "{}: tensor {}: no data", path, name);
    json entry = {{"dtype", std::string(dtype_name(t.dtype))},
                  {"shape", t.shape},
                  {"data_offsets", {offset, offset + nbytes}}};
    if (text.size() > 1) text += ",";
    text += dump(name) + ":" + dump(entry);
    offset += nbytes;
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');
  K3_CHECK(text.size() <= kMaxHeaderBytes, "{}: header of {} bytes exceeds the {} byte limit", path, text.size(),
           kMaxHeaderBytes);

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  Fd fd{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  K3_CHECK(fd.fd >= 0, "{}: cannot create {}: {}", path, tmp, std::strerror(errno));
  auto write_all = [&](const void* p, size_t len) {
    const char* c = static_cast<const char*>(p);
    while (len > 0) {
      ssize_t w = ::write(fd.fd, c, std::min<size_t>(len, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const std::string why = std::strerror(errno);
        ::unlink(tmp.c_str());
        fail("{}: write failed: {}", path, why);
      }
      c += w;
      len -= static_cast<size_t>(w);
    }
  };
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(uint64_t(text.size()) >> (8 * i));
  write_all(len_le, 8);
  write_all(text.data(), text.size());
  for (const auto& [name, t] : tensors)
    if (t.nbytes() > 0) write_all(t.data, t.nbytes());
  const int rc = ::close(fd.fd);
  fd.fd = -1;
  if (rc != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    fail("{}: write failed on close: {}", path, why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    fail("{}: cannot rename {} into place: {}", path, tmp, why);
  }
}

}  // namespace k3
