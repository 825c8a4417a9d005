// Work items of the CPU attention kernels and how they are dealt to torch's threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace prefixgate {

// A tile of one sequence's query tokens against one KV head (paged_attention.cpp's decode items
// of every head: kv_head -1).
struct WorkItem {
  int32_t sequence, kv_head, first_token, tokens;
  int64_t cost;  // keys x rows, for ordering
};

// Items dealt to threads so that they finish together: largest first, each to the thread with
// the least work so far.
inline std::vector<std::vector<WorkItem>> balance(std::vector<WorkItem> items, int64_t threads) {
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, items.size()));
  std::vector<std::vector<WorkItem>> lanes(threads);
  std::vector<int64_t> load(threads, 0);
  for (const WorkItem& item : items) {
    const int64_t lightest = std::min_element(load.begin(), load.end()) - load.begin();
    lanes[lightest].push_back(item);
    load[lightest] += item.cost;
  }
  return lanes;
}

}  // namespace prefixgate
