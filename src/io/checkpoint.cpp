// Checkpoint (io/checkpoint.h): a single safetensors file or an index of shards; MemoryCheckpoint.
#include "io/checkpoint.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/error.h"
#include "io/safetensors.h"

namespace k3 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// weight_map of an index file: tensor name -> shard file name (a plain name inside the directory).
std::map<std::string, std::string> read_weight_map(const fs::path& index_path) {
  const std::string where = index_path.string();
  std::ifstream in(index_path);
  K3_CHECK(in.good(), "{}: cannot open", where);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", where, e.what());
  }
  K3_CHECK(j.is_object(), "{}: top level is a JSON {}, not an object", where, j.type_name());
  auto wm = j.find("weight_map");
  K3_CHECK(wm != j.end() && wm->is_object(), "{}: missing or non-object \"weight_map\"", where);
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : wm->items()) {
    K3_CHECK(file.is_string(), "{}: weight_map entry for tensor {} is a JSON {}, not a file name", where, name,
             file.type_name());
    const auto& f = file.get_ref<const std::string&>();
    K3_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
             "{}: weight_map entry for tensor {} names \"{}\", not a file of the directory", where, name, f);
    out[name] = f;
  }
  return out;
}

// Writes text to path through a temporary file and a rename.
void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    K3_CHECK(out.good(), "{}: cannot create", tmp.string());
    out << text;
    out.close();
    K3_CHECK(!out.fail(), "{}: write failed", tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  K3_CHECK(!ec, "{}: cannot rename into place: {}", path.string(), ec.message());
}

void remove_if_present(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
  K3_CHECK(!ec, "{}: cannot remove stale file: {}", p.string(), ec.message());
}

}  // namespace

Checkpoint::~Checkpoint() = default;

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  K3_CHECK(fs::is_directory(d, ec), "checkpoint {}: not a directory", dir);
  K3_CHECK(is_file(d / "config.json"), "checkpoint {}: no config.json", dir);

  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  ck->dir_ = dir;
  ck->config_ = ModelConfig::from_file((d / "config.json").string());

  const fs::path index = d / kIndexFile;
  if (is_file(index)) {
    const auto weight_map = read_weight_map(index);
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& [name, file] : weight_map) {
      if (by_file.count(file)) continue;
      K3_CHECK(is_file(d / file), "{}: tensor {} is in {}, which does not exist in {}", index.string(), name, file,
               dir);
      ck->files_.push_back(SafetensorsFile::open((d / file).string()));
      by_file[file] = ck->files_.back().get();
    }
    for (const auto& f : ck->files_) {
      for (const auto& name : f->names()) {
        auto [it, fresh] = ck->where_.emplace(name, f.get());
        K3_CHECK(fresh, "checkpoint {}: tensor {} is in both {} and {}", dir, name, it->second->path(), f->path());
      }
    }
    for (const auto& [name, file] : weight_map) {
      auto it = ck->where_.find(name);
      K3_CHECK(it != ck->where_.end() && it->second == by_file.at(file), "{}: tensor {} is not in {}",
               index.string(), name, file);
    }
    for (const auto& [name, file] : ck->where_)
      K3_CHECK(weight_map.count(name), "{}: tensor {} of {} is not in the weight_map", index.string(), name,
               file->path());
  } else {
    const fs::path single = d / kSingleFile;
    K3_CHECK(is_file(single), "checkpoint {}: neither {} nor {} found", dir, kSingleFile, kIndexFile);
    ck->files_.push_back(SafetensorsFile::open(single.string()));
    for (const auto& name : ck->files_.back()->names()) ck->where_.emplace(name, ck->files_.back().get());
  }
  return ck;
}

bool Checkpoint::has(const std::string& name) const { return where_.count(name) != 0; }

TensorView Checkpoint::get(const std::string& name) const {
  auto it = where_.find(name);
  K3_CHECK(it != where_.end(), "checkpoint {}: no tensor {}", dir_, name);
  return it->second->get(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

void MemoryCheckpoint::add(const std::string& name, Tensor t) {
  K3_CHECK(!tensors_.count(name), "tensor {}: added twice", name);
  tensors_.emplace(name, std::move(t));
  order_.push_back(name);
}

TensorView MemoryCheckpoint::get(const std::string& name) const {
  auto it = tensors_.find(name);
  K3_CHECK(it != tensors_.end(), "no tensor {} in memory checkpoint", name);
  return it->second.view();
}

std::vector<std::string> MemoryCheckpoint::names() const { return order_; }

Tensor& MemoryCheckpoint::mutable_tensor(const std::string& name) {
  auto it = tensors_.find(name);
  K3_CHECK(it != tensors_.end(), "no tensor {} in memory checkpoint", name);
  return it->second;
}

void write_checkpoint(const std::string& dir, const ModelConfig& config, const TensorSource& src,
                      size_t max_shard_bytes) {
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  K3_CHECK(!ec, "{}: cannot create directory: {}", dir, ec.message());
  write_text(d / "config.json", config.to_json().dump(1));

  // Shards in names() order: a new shard starts when the next tensor would overflow a non-empty one.
  std::vector<std::vector<std::pair<std::string, TensorView>>> shards(1);
  std::vector<size_t> shard_bytes(1, 0);
  size_t total = 0;
  for (const auto& name : src.names()) {
    TensorView v = src.get(name);
    const size_t n = v.nbytes();
    total += n;
    if (!shards.back().empty() && shard_bytes.back() + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().emplace_back(name, std::move(v));
    shard_bytes.back() += n;
  }
  const std::map<std::string, std::string> metadata{{"format", "pt"}};

  // A stale file of the other layout would shadow or confuse the new one.
  if (total <= max_shard_bytes) {
    std::vector<std::pair<std::string, TensorView>> all;
    for (auto& s : shards) all.insert(all.end(), s.begin(), s.end());
    remove_if_present(d / kIndexFile);
    write_safetensors((d / kSingleFile).string(), all, metadata);
    return;
  }
  remove_if_present(d / kSingleFile);
  json weight_map = json::object();
  const size_t count = shards.size();
  for (size_t i = 0; i < count; ++i) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, count);
    write_safetensors((d / file).string(), shards[i], metadata);
    for (const auto& [name, view] : shards[i]) weight_map[name] = file;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text(d / kIndexFile, index.dump(2));
}

}  // namespace k3
