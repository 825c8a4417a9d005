-- One tenant's limits in Redis: each call is one atomic admission step (see redis_store.py).
-- KEYS[1] requests:     zset lease -> admitted at (ms)
-- KEYS[2] token times:  zset lease -> charged at (ms)
-- KEYS[3] token counts: hash lease -> tokens charged
-- KEYS[4] token sum:    string, the sum of KEYS[3]
-- KEYS[5] slots:        zset "lease:i" -> lease expiry (ms)
-- ARGV[1] the step, ARGV[2] window (ms), ARGV[3] lease id, then the step's own arguments.
-- Times are the Redis server's, so every gateway reads one clock.

local window = tonumber(ARGV[2])
local lease = ARGV[3]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local CHUNK = 1000  -- unpack() takes a bounded number of values

local function forget_old()
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window)
  local freed = 0
  for first = 1, #old, CHUNK do
    local last = math.min(first + CHUNK - 1, #old)
    local counts = redis.call('HMGET', KEYS[3], unpack(old, first, last))
    for i = 1, #counts do freed = freed + (tonumber(counts[i]) or 0) end
    redis.call('HDEL', KEYS[3], unpack(old, first, last))
  end
  if #old > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
    redis.call('DECRBY', KEYS[4], freed)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
end

local function token_sum()
  return math.max(0, tonumber(redis.call('GET', KEYS[4]) or '0'))
end

local function newest(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

-- {refusal (0 none, 1 concurrency, 2 requests, 3 tokens), wait (ms), requests used,
--  requests reset (ms), tokens used, tokens reset (ms), slots held, now (ms),
--  token entries (time, tokens)...}
local function answer(refusal, wait, entries)
  local reply = {refusal, wait, redis.call('ZCARD', KEYS[1]), newest(KEYS[1]), token_sum(),
                 newest(KEYS[2]), redis.call('ZCARD', KEYS[5]), now}
  for i = 1, #entries do reply[#reply + 1] = entries[i] end
  return reply
end

local function keep_for(ms)
  for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], ms) end
end

local function take_slots(from, count, lease_ms)
  for i = from, from + count - 1 do
    redis.call('ZADD', KEYS[5], now + lease_ms, lease .. ':' .. i)
  end
end

-- The refusal (2) when the window already holds `per_minute` requests, else nil.
local function requests_refusal(per_minute)
  if redis.call('ZCARD', KEYS[1]) < per_minute then return nil end
  -- The caller works out the wait from the window's entries (time, 1), oldest first.
  local times = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local entries = {}
  for i = 1, #times, 2 do
    entries[#entries + 1] = times[i + 1]
    entries[#entries + 1] = 1
  end
  return answer(2, 0, entries)
end

local step = ARGV[1]

if step == 'enter' then
  local per_minute, most, lease_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  forget_old()
  if redis.call('ZCARD', KEYS[5]) >= most then return answer(1, 1000, {}) end
  local refused = requests_refusal(per_minute)
  if refused then return refused end
  redis.call('ZADD', KEYS[1], now, lease)
  take_slots(0, 1, lease_ms)
  keep_for(window + lease_ms)
  return answer(0, 0, {})
end

if step == 'count' then
  local per_minute = tonumber(ARGV[4])
  forget_old()
  local refused = requests_refusal(per_minute)
  if refused then return refused end
  redis.call('ZADD', KEYS[1], now, lease)
  -- Only the window's key: the others may hold leases that must outlive it.
  if redis.call('PTTL', KEYS[1]) < window then redis.call('PEXPIRE', KEYS[1], window) end
  return answer(0, 0, {})
end

if step == 'charge' then
  local tokens, extra, most = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  local per_minute, lease_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
  forget_old()
  if redis.call('ZCARD', KEYS[5]) + extra > most then return answer(1, 1000, {}) end
  if token_sum() + tokens > per_minute then
    -- The caller works out the wait from the window's entries (time, tokens), oldest first.
    local times = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local entries = {}
    for i = 1, #times, 2 do
      entries[#entries + 1] = times[i + 1]
      entries[#entries + 1] = redis.call('HGET', KEYS[3], times[i]) or '0'
    end
    return answer(3, 0, entries)
  end
  if tokens > 0 then
    redis.call('ZADD', KEYS[2], now, lease)
    redis.call('HSET', KEYS[3], lease, tokens)
    redis.call('INCRBY', KEYS[4], tokens)
  end
  take_slots(1, extra, lease_ms)
  keep_for(window + lease_ms)
  return answer(0, 0, {})
end

if step == 'release' then
  local slots, refund = tonumber(ARGV[4]), tonumber(ARGV[5])
  for i = 0, slots - 1 do redis.call('ZREM', KEYS[5], lease .. ':' .. i) end
  if refund > 0 then
    local charged = tonumber(redis.call('HGET', KEYS[3], lease) or '0')
    local back = math.min(charged, refund)
    if back > 0 then
      redis.call('HSET', KEYS[3], lease, charged - back)
      redis.call('DECRBY', KEYS[4], back)
    end
  end
  return 0
end

if step == 'renew' then
  -- ARGV[4] lease length (ms), then (lease, slots) pairs: only slots still held are renewed.
  local lease_ms, renewed = tonumber(ARGV[4]), 0
  for i = 5, #ARGV, 2 do
    for slot = 0, tonumber(ARGV[i + 1]) - 1 do
      renewed = renewed + redis.call('ZADD', KEYS[5], 'XX', 'CH', now + lease_ms,
                                     ARGV[i] .. ':' .. slot)
    end
  end
  redis.call('PEXPIRE', KEYS[5], window + lease_ms)
  return renewed
end

return redis.error_reply('unknown step ' .. tostring(step))
